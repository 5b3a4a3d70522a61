"""Draft-training data: prompts the target writes itself (Magpie-style), their filters and
near-duplicate index, regeneration with sampled answers, and the per-category held-out split.
Generation is a scripted stand-in here (the logic under test is what happens around it); the slow
test runs the real SmolLM2 through `jaxspec train-draft --synthesize`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxspec.train.data import load_tagged, regenerate, split_held_out
from jaxspec.train.synth import CATEGORIES, NearDuplicates, clean_prompt, synthesize, user_turn_prefix

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def sentence(rng, n=14):
    return " ".join(rng.choice(WORDS, n)) + "?"


class Tok:
    """A chat template with system and user turns, like ChatML."""

    all_special_tokens = ("<|im_start|>", "<|im_end|>")

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Scripted:
    """Engine stand-in: generate() answers each request from `script(prefix, params)`; records calls."""

    def __init__(self, script):
        self.tokenizer, self.script, self.calls, self.prefixes = Tok(), script, [], []

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]

    def apply_chat_template(self, msgs):
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)

    def generate(self, input_ids, sampling_params):
        self.calls.append(sampling_params)
        prefix = "".join(map(chr, input_ids[0]))
        self.prefixes.append((next(c for c, text in CATEGORIES.items() if text in prefix), prefix))
        out = []
        for p in sampling_params:
            text, reason = self.script(prefix, p)
            out.append({"text": text, "meta_info": {"finish_reason": {"type": reason}}})
        return out

    def chat(self, msgs, params):
        self.calls.append(params)
        return [
            {"text": f"answer to {m[-1]['content'][:12]} T={p['temperature']} seed={p.get('seed')}"}
            for m, p in zip(msgs, params)
        ]


def test_user_turn_prefix_stops_where_the_user_text_starts():
    prefix, end = user_turn_prefix(Tok(), CATEGORIES["math"])
    assert prefix.startswith("<|im_start|>system\nYou are a helpful assistant. The user asks a math problem")
    assert prefix.endswith("<|im_end|>\n<|im_start|>user\n") and end == "<|im_end|>"


@pytest.mark.parametrize(
    "text,reason,why",
    [
        ("How do I sort a list of tuples by their second element in Python?", "stop", ""),
        ("How do I sort a list of tuples by their second", "length", "cut off"),
        ("Hi?", "stop", "too short"),
        ("Write a poem <|im_start|>assistant about the sea", "stop", "template token"),
        ("the cat sat on the mat " * 10, "stop", "repetitive"),
        ("Please explain this to me: " + "!" * 40, "stop", "repetitive"),
        ("1 + 2 = ? 3 * 4 = ? 5 - 6 = ? 7 / 8 = ? 9 % 2 = ?", "stop", "not text"),
    ],
)
def test_clean_prompt(text, reason, why):
    kept, got = clean_prompt(text, reason, Tok.all_special_tokens)
    assert got == why and (kept is None) == bool(why)


def test_near_duplicates():
    rng = np.random.default_rng(0)
    idx = NearDuplicates(threshold=0.7)
    texts = [sentence(rng, 30) for _ in range(300)]
    for t in texts:
        assert idx.match(t) is None  # random 30-word sentences over 19 words share few 3-grams
        idx.add(t)
    w = texts[17].split()
    w[5] = "changed"  # one word of 30: Jaccard 25/31 ~ 0.8
    assert idx.match(" ".join(w)) == 17
    assert idx.match(texts[42].upper()) == 42  # case and punctuation do not matter
    w = texts[3].split()
    assert idx.match(" ".join(w[:12])) is None  # a 12-word prefix: Jaccard ~ 0.36


def test_synthesize_spreads_filters_and_resumes(tmp_path):
    rng = np.random.default_rng(1)
    pool = [sentence(rng) for _ in range(200)]
    state = {"n": 0}

    def script(prefix, p):
        state["n"] += 1
        k = state["n"]
        if k % 3 == 0:
            return pool[0], "stop"  # the same prompt again and again: a near-duplicate after the first
        if k % 7 == 0:
            return "cut off in the midd", "length"
        return pool[k], "stop"

    cache = str(tmp_path / "synth.jsonl")
    eng = Scripted(script)
    got = synthesize(eng, 10, ["math", "coding"], cache_path=cache, batch=4, seed=3)
    cats = [c for c, _ in got]
    assert cats == ["math"] * 5 + ["coding"] * 5
    assert len({p for _, p in got}) == 10 and pool[0] in {p for _, p in got}
    recs = [json.loads(line) for line in open(cache)]
    assert {r.get("dropped") for r in recs} >= {None, "near-duplicate", "cut off"}
    seeds = [p["seed"] for call in eng.calls for p in call]
    assert len(set(seeds)) == len(seeds)  # every attempt its own seed
    # each category's prompts were written after its own system prompt, and stop at the end of a turn
    assert all(p["stop"] == "<|im_end|>" for call in eng.calls for p in call)
    written = [c for c, _ in eng.prefixes]  # the categories take turns, one batch each
    assert written[:2] == ["math", "coding"] and set(written) == {"math", "coding"}
    assert all(pre.endswith("<|im_start|>user\n") for _, pre in eng.prefixes)

    # a rerun with a larger count keeps the first prompts, asks only for new ones, same seeds per attempt
    eng2 = Scripted(script)
    more = synthesize(eng2, 14, ["math", "coding"], cache_path=cache, batch=4, seed=3)
    assert [p for c, p in more if c == "math"][:5] == [p for c, p in got if c == "math"]
    assert len(more) == 14
    new_seeds = [p["seed"] for call in eng2.calls for p in call]
    assert not set(new_seeds) & set(seeds)
    # and a run from scratch draws the same seeds for the same attempts (the first batch: what comes
    # after depends on what the scripted model writes, which differs on a second pass)
    eng3 = Scripted(script)
    synthesize(eng3, 10, ["math", "coding"], batch=4, seed=3)
    assert [p["seed"] for p in eng3.calls[0]] == [p["seed"] for p in eng.calls[0]]


def test_synthesize_gives_up_on_a_model_that_writes_nothing_usable(tmp_path):
    eng = Scripted(lambda prefix, p: ("", "stop"))
    assert synthesize(eng, 4, ["writing"], batch=8, max_attempts_per_prompt=3) == []
    assert sum(len(c) for c in eng.calls) == 12
    with pytest.raises(Exception, match="unknown prompt categories"):
        synthesize(eng, 4, ["poetry"])


def test_regenerate_with_sampled_answers_resumes(tmp_path):
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "-"}] for i in range(3)]
    cache = str(tmp_path / "train_data.jsonl")
    eng = Scripted(None)
    out = regenerate(eng, convs[:2], 8, batch=4, cache_path=cache, samples=2, categories=["math", "coding"])
    assert len(out) == 6
    recs = [json.loads(line) for line in open(cache)]
    assert [(r["src"], r["k"], r["category"]) for r in recs] == [
        (i, k, c) for i, c in enumerate(["math", "coding"]) for k in range(3)
    ]
    greedy = [r["messages"][-1]["content"] for r in recs if r["k"] == 0]
    assert all("T=0 " in g for g in greedy)
    sampled = [r["messages"][-1]["content"] for r in recs if r["k"] > 0]
    assert all("T=1.0" in s for s in sampled) and len(set(sampled)) == 4
    asked = sum(len(c) for c in eng.calls)
    again = regenerate(eng, convs, 8, batch=4, cache_path=cache, samples=2, categories=["math", "coding", "math"])
    assert sum(len(c) for c in eng.calls) - asked == 3 and again[:6] == out and len(again) == 9
    tagged = load_tagged(cache)
    assert [c for c, _ in tagged] == ["math"] * 3 + ["coding"] * 3 + ["math"] * 3

    # the cache is keyed by prompt content: a reordered, grown list asks only for the new prompts,
    # and a prompt's sampled answers keep their seeds wherever it stands in the list
    new = [[{"role": "user", "content": "question new"}, {"role": "assistant", "content": "-"}]]
    asked = sum(len(c) for c in eng.calls)
    third = regenerate(eng, new + convs[::-1], 8, batch=4, cache_path=cache, samples=2)
    calls = [p for c in eng.calls for p in c][asked:]
    assert len(calls) == 3 and len(third) == 12 and third[3:6] == again[6:9]
    fresh = Scripted(None)
    regenerate(fresh, convs[::-1], 8, batch=16, samples=2)
    seeds = lambda c: sorted(p.get("seed", -1) for p in c)
    assert seeds(fresh.calls[0]) == seeds([p for c in eng.calls for p in c][:asked])


def test_held_out_split_is_per_category_and_never_trained_on():
    def conv(q, a):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    tagged = []
    for c in ("math", "coding", "sharegpt"):
        for i in range(4):
            tagged += [
                (c, conv(f"{c} {i}", "greedy")),
                (c, conv(f"{c} {i}", "sampled 1")),
                (c, conv(f"{c} {i}", "sampled 2")),
            ]
    held, train = split_held_out(tagged, 5)
    assert sorted(c for c, _ in held) == ["coding", "coding", "math", "math", "sharegpt"]
    assert all(m[-1]["content"] == "greedy" for _, m in held)
    held_q = {m[0]["content"] for _, m in held}
    assert not held_q & {m[0]["content"] for _, m in train}
    assert len(train) == len(tagged) - 3 * len(held)


@pytest.mark.slow
def test_train_draft_synthesize_end_to_end(tmp_path):
    """The real SmolLM2 writes prompts, answers them (greedy + 1 sample), and a head trains 2 steps."""
    from jaxspec.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "-"}]})
            for q in ("Name three colours.", "What is the capital of France?")
        )
    )
    out = tmp_path / "head"
    args = f"train-draft --data {data} --num-samples 1 --eval-samples 1 --regenerate --synthesize 2 --synth-categories math,coding "
    args += f"--regen-samples 1 --regen-max-new-tokens 24 --regen-batch-size 4 --steps 2 --batch-size 2 --max-len 256 --out {out}"
    assert main(args.split()) == 0
    synth = [json.loads(line) for line in open(out / "synth_prompts.jsonl")]
    assert sum(1 for r in synth if r["prompt"]) == 2
    ev = json.loads((out / "eval.json").read_text())
    assert ev["held_out_per_category"] and "4096" in ev["draft_vocab_coverage"]
    tagged = load_tagged(str(out / "train_data.jsonl"))
    assert {c for c, _ in tagged} == {"chat", "math", "coding"} and len(tagged) >= 6


def test_deadlines_stop_after_one_batch_and_json_prompts_get_a_grammar(tmp_path):
    import time

    from jaxspec.train.synth import ANSWER_PARAMS

    rng = np.random.default_rng(2)
    eng = Scripted(lambda prefix, p: (sentence(rng), "stop"))
    late = time.monotonic() - 1  # already past: the first batch still runs, no second one
    got = synthesize(eng, 12, ["math", "json", "coding"], batch=2, deadline=late)
    assert len(eng.calls) == 1 and len(got) == 2 and {c for c, _ in got} == {"math"}
    got = synthesize(eng, 6, ["math", "json", "coding"], batch=2)  # no deadline: every category, in turns
    assert [c for c, _ in eng.prefixes[1:4]] == ["math", "json", "coding"] and len(got) == 6

    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "-"}] for i in range(6)]
    cats = ["json", "math"] * 3
    eng = Scripted(None)
    out = regenerate(eng, convs, 8, batch=4, samples=1, categories=cats, category_params=ANSWER_PARAMS, deadline=late)
    assert len(eng.calls) == 1 and len(out) == len(eng.calls[0]) == 3  # the greedy answers of one kind
    assert all(p["temperature"] == 0 for p in eng.calls[0])  # greedy answers come first under a deadline
    eng = Scripted(None)
    regenerate(eng, convs, 8, batch=4, samples=1, categories=cats, category_params=ANSWER_PARAMS)
    asked = [p for c in eng.calls for p in c]
    assert len(asked) == 12 and sum("json_schema" in p for p in asked) == 6  # the json prompts' answers
    assert all(len({"json_schema" in p for p in call}) == 1 for call in eng.calls)  # constrained in batches apart

"""Draft training on a tiny random target: loss falls, accuracy rises, and the exported head
reloads through the public layout and stays lossless."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxspec.engine import Engine
from jaxspec.loader import load
from jaxspec.train.data import Example, draft_vocab, load_conversations, tokenize
from jaxspec.train.trainer import TrainConfig, Trainer

from helpers import make_hf_model

V = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_target")
    import torch

    hf = make_hf_model("llama", 7, vocab_size=V, num_hidden_layers=8, initializer_range=0.6)
    with torch.no_grad():
        # A learnable target: attention outputs zeroed (the next token depends on the current one
        # only) and sharpened logits. A random deep transformer's next-token function is too
        # arbitrary to learn from a few hundred sequences in a unit test.
        hf.model.norm.weight.mul_(6.0)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    hf.save_pretrained(d)
    loaded = load(str(d), with_tokenizer=False, progress=False)
    eng = Engine(_loaded=loaded, max_running_requests=64, show_progress=False)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, V, 4)) for _ in range(640)]
    outs = eng.generate(
        input_ids=prompts,
        sampling_params=[dict(temperature=1.0, max_new_tokens=28, ignore_eos=True, seed=i) for i in range(640)],
    )
    examples = [Example(p + o["output_ids"], [0] * len(p) + [1] * len(o["output_ids"])) for p, o in zip(prompts, outs)]
    return str(d), loaded, hf.config.to_dict(), examples


@pytest.mark.parametrize("algo", ["EAGLE3", pytest.param("EAGLE", marks=pytest.mark.slow)])
def test_training_improves_and_export_is_lossless(target, algo, tmp_path):
    path, loaded, cfg_dict, examples = target
    held, train = examples[:32], examples[32:]
    cfg = TrainConfig(
        algorithm=algo,
        steps=200,
        batch_size=8,
        max_len=32,
        lr=1e-2,
        warmup=20,
        clip=5.0,
        ttt_steps=3,
        draft_vocab_size=48,
        save_every=100,
    )
    tr = Trainer(loaded, cfg_dict, train, cfg, str(tmp_path), progress=False)
    before = tr.evaluate(held)
    tr.train()
    after = tr.evaluate(held)
    assert after["loss"] < 0.5 * before["loss"]  # on held-out sequences
    assert after["acc_0"] > before["acc_0"] + 0.4
    out = tr.export()
    log = json.load(open(f"{out}/train_log.json"))
    assert len(log["log"]) == 200 and (tmp_path / "loss.svg").exists()
    # reload through the public layout: lossless, and it accepts more than an untrained head would
    eng = Engine(
        path,
        skip_tokenizer_init=True,
        show_progress=False,
        speculative_algorithm=algo,
        speculative_draft_model_path=out,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
    )
    plain = Engine(_loaded=loaded, show_progress=False)
    prompts = [e.ids[:4] for e in held[:4]]
    sp = dict(temperature=0, max_new_tokens=24, ignore_eos=True)
    got = eng.generate(input_ids=prompts, sampling_params=sp)
    assert [r["output_ids"] for r in got] == [
        r["output_ids"] for r in plain.generate(input_ids=prompts, sampling_params=sp)
    ]
    assert np.mean([r["meta_info"]["spec_accept_length"] for r in got]) > 2.0


def test_resume_from_checkpoint(target, tmp_path):
    _, loaded, cfg_dict, examples = target
    cfg = TrainConfig(
        algorithm="EAGLE3", steps=6, batch_size=4, max_len=32, ttt_steps=2, draft_vocab_size=48, save_every=3
    )
    Trainer(loaded, cfg_dict, examples, cfg, str(tmp_path), progress=False).train()
    again = Trainer(
        loaded, cfg_dict, examples, TrainConfig(**{**cfg.__dict__, "steps": 9}), str(tmp_path), progress=False
    )
    assert again.restore() and again.step == 6
    again.train()
    assert again.step == 9 and [r["step"] for r in again.log] == list(range(1, 10))


def test_chat_data_and_masks(default_engine, tmp_path):
    tok = default_engine.tokenizer
    convs = [
        {
            "conversations": [
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "Hello! How can I help?"},
                {"from": "human", "value": "Tell me a joke"},
                {"from": "gpt", "value": "Why did the chicken cross the road?"},
            ]
        },
        {"messages": [{"role": "assistant", "content": "starts with the assistant"}]},
    ]
    f = tmp_path / "chats.jsonl"
    f.write_text("\n".join(json.dumps(c) for c in convs))
    loaded = load_conversations(str(f))
    assert len(loaded) == 1  # the second conversation is unusable
    ex = tokenize(tok, loaded[0], 512)
    text = tok.decode([t for t, m in zip(ex.ids, ex.mask) if m])
    assert "Hello! How can I help?" in text and "Why did the chicken" in text
    assert "Hi there" not in text and "Tell me a joke" not in text
    vocab = draft_vocab([ex], 8, 49152, always=[2])
    assert 2 in vocab and len(vocab) == 8


@pytest.mark.slow
def test_regeneration_is_cached_and_resumes(default_engine, tmp_path):
    from jaxspec.train.data import regenerate

    class Counting:  # the real engine, counting the conversations it is asked to answer
        def __init__(self, eng):
            self.eng, self.asked = eng, 0

        def __getattr__(self, name):
            return getattr(self.eng, name)

        def chat(self, msgs, sp):
            self.asked += len(msgs)
            return self.eng.chat(msgs, sp)

    convs = [
        [{"role": "user", "content": f"Say the number {i}."}, {"role": "assistant", "content": "old answer"}]
        for i in range(3)
    ]
    cache = str(tmp_path / "regen.jsonl")
    eng = Counting(default_engine)
    first = regenerate(eng, convs[:2], 6, batch=2, cache_path=cache)
    assert eng.asked == 2 and len(first) == 2 and all(c[-1]["content"] != "old answer" for c in first)
    again = regenerate(eng, convs, 6, batch=2, cache_path=cache)  # only the third conversation is new
    assert eng.asked == 3 and again[:2] == first and len(again) == 3
    assert [json.loads(line)["src"] for line in open(cache)] == [0, 1, 2]


def test_length_bucketed_batches(target, tmp_path):
    _, loaded, cfg_dict, _ = target
    rng = np.random.default_rng(1)
    examples = [Example(list(rng.integers(0, V, n)), [1] * n) for n in rng.integers(3, 300, 40)]
    cfg = TrainConfig(algorithm="EAGLE3", steps=25, batch_size=4, max_len=256, draft_vocab_size=48)
    tr = Trainer(loaded, cfg_dict, examples, cfg, str(tmp_path), progress=False)
    seen = list(tr._batches())
    assert [s for s, _ in seen] == list(range(25))
    for _, (ids, mask) in seen:
        assert ids.shape[1] in (128, 256) and mask.shape == ids.shape
        n = mask.sum(1)
        assert n.max() > ids.shape[1] - 128 or ids.shape[1] == 128  # padded to the smallest bucket that fits
    epoch = np.concatenate([mask.sum(1) for _, (_, mask) in seen[:10]])
    assert sorted(epoch) == sorted(min(len(e.ids), 256) for e in examples)  # one epoch = every example once
    tr.step = 7  # a resumed run continues with the same batches
    assert all((a[1][0] == b[1][0]).all() for a, b in zip(tr._batches(), seen[7:]))


def test_a_deadline_fits_the_schedule_and_a_later_run_starts_from_the_head(target, tmp_path):
    import time

    _, loaded, cfg_dict, examples = target
    cfg = TrainConfig(
        algorithm="EAGLE3", steps=100_000, batch_size=4, max_len=32, ttt_steps=2, draft_vocab_size=48, warmup=5
    )
    tr = Trainer(loaded, cfg_dict, examples[32:], cfg, str(tmp_path / "a"), progress=False)
    tr._compile_buckets()  # (train() does it too; here first, so that the deadline below is all steps)
    t0 = time.monotonic()
    tr.train(deadline=t0 + 5)
    assert time.monotonic() - t0 < 5 + 3
    assert 25 < tr.step < 100_000 and abs(tr.planned - tr.step) <= 0.5 * tr.step
    # the schedule was fitted to the steps that fit: it ends near a tenth of the peak, not at the peak
    assert tr.log[-1]["lr"] < 0.4 * cfg.lr and max(r["lr"] for r in tr.log) == pytest.approx(cfg.lr, rel=0.05)
    held = examples[:32]
    trained = tr.evaluate(held)
    out = tr.export("float32")
    again = Trainer(loaded, cfg_dict, examples[32:], cfg, str(tmp_path / "b"), progress=False, init_head=out)
    assert np.array_equal(again.ids, tr.ids)
    assert again.evaluate(held)["loss"] == pytest.approx(trained["loss"], rel=1e-4)
    with pytest.raises(Exception, match="not an EAGLE head"):
        Trainer(loaded, cfg_dict, examples, TrainConfig(algorithm="EAGLE", steps=1), str(tmp_path / "c"), init_head=out)

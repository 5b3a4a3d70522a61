"""Prompt synthesis from the target itself (Magpie-style), and near-duplicate filtering.

The chat template is filled up to the point where a user turn's text begins, after a system prompt
that names a category; an instruction-tuned model continues with what a user of that category would
ask, in its own style, until its end-of-turn token. So the prompts never run out, cover the
categories users ask about, and need no dataset beyond the model.

Kept prompts pass `clean_prompt` (not cut off, no template tokens, no degenerate repetition, enough
words) and are not near-duplicates (word 3-gram Jaccard similarity, MinHash-banded so a large set
stays cheap) of each other or of evaluation questions (MT-bench, when installed), which no draft is
ever trained on.

    synthesize(engine, 800, cache_path="out/synth_prompts.jsonl")  # -> [(category, prompt), ...]

Every attempt is appended to `cache_path` as soon as its batch finishes (kept or with the reason it
was dropped), and attempt i of a category always uses the same seed, so an interrupted run resumes
where it stopped and a rerun reproduces the same prompts. Categories take turns, one batch each, so
a run stopped early (or by a deadline) is spread over all of them.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import zlib
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxspec.errors import JaxspecError

# What each category's user asks about: the system prompt the target sees before writing the
# question. MT-bench's eight categories, which is what users of a chat model ask for.
CATEGORIES: dict[str, str] = {
    "writing": "You are a helpful assistant. The user asks for help with writing: a story, a poem, an email, a blog post, a speech or an essay.",
    "roleplay": "You are a helpful assistant. The user asks you to play a character or a role, or to imagine yourself in a situation, and answer as that character.",
    "reasoning": "You are a helpful assistant. The user asks a logic puzzle, a riddle or a question that takes careful step-by-step reasoning.",
    "math": "You are a helpful assistant. The user asks a math problem: arithmetic, algebra, geometry, probability or a word problem.",
    "coding": "You are a helpful assistant. The user asks for help with programming: writing a function, fixing a bug or explaining code.",
    "extraction": "You are a helpful assistant. The user gives you a text and asks you to extract, summarise or reformat information from it.",
    "stem": "You are a helpful assistant. The user asks a question about science, technology, engineering or medicine.",
    "humanities": "You are a helpful assistant. The user asks a question about history, philosophy, economics, law, art or society.",
    "json": "You are a helpful assistant. The user asks for structured data: a JSON object describing something (a person, a product, an event, a record or a list of items), naming the fields it should have.",
}
# Extra sampling parameters for the answers to a category's prompts: "json" prompts are answered
# under a JSON grammar, so the data holds the compact JSON a server writes under response_format.
ANSWER_PARAMS: dict[str, dict] = {"json": {"json_schema": '{"type": "object"}'}}
SENTINEL = "\u2063JAXSPEC_USER_TURN\u2063"  # never produced by a tokenizer's template on its own
SHINGLE = 3  # words per shingle for near-duplicate detection


def user_turn_prefix(tokenizer, system: str | None) -> tuple[str, str]:
    """(the template text up to where a user turn's text begins, the text that ends a user turn).
    A template that refuses a system message is filled without one."""
    msgs = [{"role": "user", "content": SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(
            ([{"role": "system", "content": system}] if system else []) + msgs, tokenize=False
        )
    except Exception:  # templates raise their own errors for an unsupported system role
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
    if SENTINEL not in text:
        raise JaxspecError("the chat template does not place the user's text verbatim; cannot synthesize prompts")
    prefix, suffix = text.split(SENTINEL, 1)
    return prefix, suffix.strip()


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def clean_prompt(text: str, finish_reason: str, special: Sequence[str]) -> tuple[str | None, str]:
    """(the prompt, "") if `text` is a usable user turn, else (None, why it is not)."""
    t = text.strip()
    if finish_reason != "stop":
        return None, "cut off"
    if any(s and s in t for s in special):
        return None, "template token"
    w = words(t)
    if len(w) < 4 or len(t) < 16:
        return None, "too short"
    if len(t) > 2000:
        return None, "too long"
    grams = [tuple(w[i : i + 3]) for i in range(len(w) - 2)]
    if len(grams) >= 12 and len(set(grams)) < 0.5 * len(grams):
        return None, "repetitive"
    if re.search(r"(.)\1{24,}", t):
        return None, "repetitive"
    letters = sum(c.isalpha() for c in t)
    if letters < 0.3 * len(t.replace(" ", "")):
        return None, "not text"
    return t, ""


class NearDuplicates:
    """A set of texts that answers "is this a near-duplicate of one of them?": word 3-gram Jaccard
    similarity >= threshold, checked exactly against the candidates that share a MinHash band
    (num_perm hashes in bands of `rows`; with 64 and 4, pairs at Jaccard 0.5 share a band with
    probability 0.64, at 0.7 with 0.988)."""

    PRIME = (1 << 31) - 1

    def __init__(
        self, threshold: float = 0.7, num_perm: int = 64, rows: int = 4, seed: int = 0, exhaustive: bool = False
    ):
        rng = np.random.default_rng(seed)
        self.threshold, self.rows, self.exhaustive = threshold, rows, exhaustive
        self.a = rng.integers(1, self.PRIME, num_perm, dtype=np.uint64)
        self.b = rng.integers(0, self.PRIME, num_perm, dtype=np.uint64)
        self.buckets: dict[tuple, list[int]] = {}
        self.sets: list[set[str]] = []

    def _shingles(self, text: str) -> set[str]:
        w = words(text)
        return {" ".join(w[i : i + SHINGLE]) for i in range(max(1, len(w) - SHINGLE + 1))}

    def _bands(self, sh: set[str]) -> list[tuple]:
        h = np.asarray([zlib.crc32(s.encode()) & self.PRIME for s in sh], np.uint64)
        sig = ((self.a[:, None] * h[None, :] + self.b[:, None]) % self.PRIME).min(axis=1)
        return [(i, *sig[i : i + self.rows].tolist()) for i in range(0, len(sig), self.rows)]

    def match(self, text: str) -> int | None:
        """Index of a kept text this one nearly duplicates, or None. An exhaustive index compares with
        every kept text (exact; for small sets such as the evaluation questions)."""
        sh = self._shingles(text)
        seen: set[int] = set()
        bands = [range(len(self.sets))] if self.exhaustive else [self.buckets.get(b, ()) for b in self._bands(sh)]
        for cands in bands:
            for j in cands:
                if j not in seen:
                    seen.add(j)
                    other = self.sets[j]
                    if len(sh & other) >= self.threshold * len(sh | other):
                        return j
        return None

    def add(self, text: str) -> int:
        sh = self._shingles(text)
        self.sets.append(sh)
        for band in self._bands(sh):
            self.buckets.setdefault(band, []).append(len(self.sets) - 1)
        return len(self.sets) - 1


def eval_questions() -> list[str]:
    """Every turn of the evaluation questions no draft may train on (MT-bench's 80 x 2, when its
    package or $JAXSPEC_MTBENCH_QUESTIONS is there; else none)."""
    from jaxspec.bench import mtbench_questions

    try:
        return [t for q in mtbench_questions() for t in q]
    except (JaxspecError, OSError):
        return []


def evaluation_index(threshold: float = 0.5) -> NearDuplicates:
    """Near-duplicate index over the evaluation questions (a lower threshold: a paraphrase of an
    evaluation question counts too; exhaustive, so every pair at or above it is caught)."""
    idx = NearDuplicates(threshold, exhaustive=True)
    for q in eval_questions():
        idx.add(q)
    return idx


def synthesize(
    engine,
    count: int,
    categories: list[str] | None = None,
    cache_path: str | None = None,
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_new_tokens: int = 192,
    batch: int = 32,
    seed: int = 0,
    max_attempts_per_prompt: int = 4,
    decontaminate: bool = True,
    deadline: float | None = None,
) -> list[tuple[str, str]]:
    """Up to `count` new user prompts written by the target, spread evenly over `categories` (default
    all of CATEGORIES): [(category, prompt)] in a stable order. A category stops after
    max_attempts_per_prompt x its share of attempts, so a model that mostly writes unusable text
    ends the run instead of looping. decontaminate: drop prompts near an evaluation question.
    deadline: a time.monotonic() value after which no batch is started."""
    cats = list(categories or CATEGORIES)
    unknown = [c for c in cats if c not in CATEGORIES]
    if unknown:
        raise JaxspecError(f"unknown prompt categories {unknown}; known: {', '.join(CATEGORIES)}")
    tok = engine.tokenizer
    if tok is None:
        raise JaxspecError("prompt synthesis needs the target's tokenizer")
    quota = {c: count // len(cats) + (i < count % len(cats)) for i, c in enumerate(cats)}
    special = [s for s in tok.all_special_tokens if len(s) > 1]
    dedup, evals = NearDuplicates(), evaluation_index() if decontaminate else NearDuplicates()
    kept: dict[str, list[str]] = {c: [] for c in cats}
    tried = {c: 0 for c in cats}
    if cache_path and os.path.exists(cache_path):
        with open(cache_path) as f:
            for line in f:
                r = json.loads(line)
                if r["category"] in tried:
                    tried[r["category"]] = max(tried[r["category"]], r["i"] + 1)
                    if r.get("prompt") and len(kept[r["category"]]) < quota[r["category"]]:
                        kept[r["category"]].append(r["prompt"])
                        dedup.add(r["prompt"])
    stops = {c: user_turn_prefix(tok, CATEGORIES[c]) for c in cats}
    total = sum(quota.values())
    bar = tqdm(total=total, initial=sum(len(v) for v in kept.values()), desc="synthesizing prompts", unit="prompt")
    limit = {c: max_attempts_per_prompt * max(quota[c], 1) for c in cats}

    def busy(c: str) -> bool:
        return len(kept[c]) < quota[c] and tried[c] < limit[c]

    while any(busy(c) for c in cats):  # a deadline is checked after each batch: the first always runs
        for c in filter(busy, cats):
            prefix, end = stops[c]
            n = min(batch, limit[c] - tried[c], math.ceil((quota[c] - len(kept[c])) * 1.5))
            first = tried[c]
            params = [
                {
                    "temperature": temperature,
                    "top_p": top_p,
                    "max_new_tokens": max_new_tokens,
                    "seed": zlib.crc32(f"{seed}/{c}/{first + j}".encode()),
                    **({"stop": end} if end else {}),
                }
                for j in range(n)
            ]
            res = engine.generate(input_ids=[engine.encode(prefix, False)] * n, sampling_params=params)
            recs = []
            for j, r in enumerate(res):
                text, why = clean_prompt(r["text"], r["meta_info"]["finish_reason"]["type"], special)
                if text is not None and len(kept[c]) >= quota[c]:
                    text, why = None, "quota reached"
                if text is not None and evals.match(text) is not None:
                    text, why = None, "evaluation question"
                if text is not None and dedup.match(text) is not None:
                    text, why = None, "near-duplicate"
                if text is not None:
                    kept[c].append(text)
                    dedup.add(text)
                    bar.update(1)
                recs.append({"category": c, "i": first + j, "prompt": text, **({"dropped": why} if why else {})})
            tried[c] += n
            if cache_path:
                with open(cache_path, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in recs)
            if deadline is not None and time.monotonic() >= deadline:
                break
        if deadline is not None and time.monotonic() >= deadline:
            break
    bar.close()
    return [(c, p) for c in cats for p in kept[c]]

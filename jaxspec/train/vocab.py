"""EAGLE-3 draft vocabularies: token coverage, and widening a trained head's vocabulary without training.

An EAGLE-3 head predicts over a draft vocabulary of `draft_vocab_size` target tokens (`d2t` maps draft
id d to target id d + d2t[d]); a token outside it can never be drafted, so every round that needs it
accepts nothing. `extend_head` adds rows to a trained head's LM head for the tokens it lacks. A row of
a trained head stays close to a linear image of the target's embedding row of the same token (the
training starts from scaled target rows), so the new rows are the target's rows through the linear
map fitted, by ridge regression, on the rows the head already has: logits on the scale the head
learnt, for tokens it never saw. Everything but the LM head, `d2t`, `t2d` and the config's
`draft_vocab_size` is copied unchanged.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from jaxspec.errors import JaxspecError

# Row count of an LM head is rounded up to a multiple of this: matmul-friendly shapes.
ROW_MULTIPLE = 256


def token_counts(sequences, vocab_size: int) -> np.ndarray:
    """[vocab_size] occurrences of each token id in `sequences` (iterables of ids)."""
    counts = np.zeros(vocab_size, np.int64)
    for ids in sequences:
        ids = np.asarray(ids, np.int64)
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def coverage(counts: np.ndarray, ids) -> float:
    """Share of the counted tokens whose id is in `ids`."""
    total = counts.sum()
    return float(counts[np.asarray(ids, np.int64)].sum() / total) if total else 0.0


def vocab_for_coverage(
    counts: np.ndarray, target: float, lo: int, hi: int, always=(), multiple: int = ROW_MULTIPLE
) -> np.ndarray:
    """The smallest draft vocabulary (a multiple of `multiple` in [lo, hi]) of the most frequent tokens
    (plus `always`) covering at least `target` of the counted tokens, or `hi` tokens if none does:
    sorted target ids."""
    counts = counts.astype(np.int64).copy()
    counts[list(always)] = counts.max() + 1
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(counts[order]) / max(counts.sum(), 1)
    need = int(np.searchsorted(cum, target) + 1)
    size = min(max(-(-need // multiple) * multiple, lo), hi, len(counts))
    return np.sort(order[:size]).astype(np.int32)


def fit_row_map(rows: np.ndarray, embed: np.ndarray, ridge: float = 1.0) -> np.ndarray:
    """[H, H] map M minimising |embed @ M - rows|^2 + ridge |M|^2 (rows, embed: [n, H])."""
    e = embed.astype(np.float64)
    return np.linalg.solve(e.T @ e + ridge * np.eye(e.shape[1]), e.T @ rows.astype(np.float64)).astype(np.float32)


def mapped_rows(lm: np.ndarray, have: np.ndarray, target_rows: np.ndarray, add, ridge: float = 1.0) -> np.ndarray:
    """LM-head rows [len(add), H] for target ids `add`, from the head's rows lm [Vd, H] for the ids
    `have` [Vd]: the target's rows (target_rows [V, H]) through the linear map fitted on the rows the
    head has (fit_row_map)."""
    target_rows = np.asarray(target_rows, np.float32)
    m = fit_row_map(np.asarray(lm, np.float32), target_rows[np.asarray(have, np.int64)], ridge)
    return target_rows[np.asarray(add, np.int64)] @ m


def retarget(have: np.ndarray, counts: np.ndarray, max_new: int, min_count: int = 2, keep=()) -> tuple:
    """A draft vocabulary of the same size, turned towards counted traffic: up to `max_new` tokens it
    lacks that occur at least `min_count` times (the most frequent first) replace as many of its tokens
    that never occur (the highest ids first: in a BPE vocabulary the latest merges, the rarest in general
    text; never those in `keep`). have: [Vd] sorted target ids; counts: [V] occurrences.
    -> (vocab [Vd] sorted target ids, src [Vd]: the index in `have` of each entry, -1 for a token added)."""
    have = np.asarray(have, np.int64)
    counts = np.asarray(counts, np.int64)
    lacking = np.ones(len(counts), bool)
    lacking[have] = False
    cand = np.flatnonzero(lacking & (counts >= min_count))
    cand = cand[np.argsort(-counts[cand], kind="stable")]
    unused = np.flatnonzero((counts[have] == 0) & ~np.isin(have, np.asarray(list(keep), np.int64)))[::-1]
    k = min(max_new, len(cand), len(unused))
    src = np.arange(len(have))
    if k == 0:
        return have.astype(np.int32), src
    kept = np.setdiff1d(src, unused[:k])
    vocab = np.concatenate([have[kept], cand[:k]])
    src = np.concatenate([kept, np.full(k, -1)])
    order = np.argsort(vocab, kind="stable")
    return vocab[order].astype(np.int32), src[order]


def extend_head(head_dir: str, target_rows: np.ndarray, add, out_dir: str, ridge: float = 1.0) -> dict:
    """Writes to `out_dir` the EAGLE-3 head of `head_dir` with its draft vocabulary widened by the
    target ids `add` (those it already has are skipped); target_rows: [V, H] the target's output
    embedding (its LM head rows, or the tied input embedding). Returns a summary: sizes and the
    held-out fit of the row map (fitted on 90% of the existing rows, scored on the rest)."""
    from safetensors.numpy import save_file

    from jaxspec.convert.sources import open_source

    src = open_source(head_dir)
    if src.kind != "eagle" or "d2t" not in src.names:
        raise JaxspecError(f"{head_dir} is not an EAGLE-3 head (no d2t)")
    tensors = {n: src.get(n) for n in src.names}
    lm = tensors["lm_head.weight"]  # [Vd, H]
    dtype = lm.dtype
    lm = lm.astype(np.float32)
    d2t = np.asarray(tensors["d2t"], np.int64)
    have = np.arange(len(d2t)) + d2t
    target_rows = np.asarray(target_rows, np.float32)
    add = np.setdiff1d(np.asarray(add, np.int64), have)
    if not len(add):
        raise JaxspecError(f"{head_dir} already has every token asked for")
    # held-out check of the row map, then the map fitted on every existing row
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(have))
    cut = int(len(perm) * 0.9)
    m = fit_row_map(lm[perm[:cut]], target_rows[have[perm[:cut]]], ridge)
    pred, true = target_rows[have[perm[cut:]]] @ m, lm[perm[cut:]]
    cos = (pred * true).sum(1) / (np.linalg.norm(pred, axis=1) * np.linalg.norm(true, axis=1) + 1e-9)
    ids = np.concatenate([have, add])
    rows = np.concatenate([lm, mapped_rows(lm, have, target_rows, add, ridge)])
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    tensors["lm_head.weight"] = rows.astype(dtype)
    tensors["d2t"] = (ids - np.arange(len(ids))).astype(tensors["d2t"].dtype)
    tensors["t2d"] = np.isin(np.arange(target_rows.shape[0]), ids)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(head_dir, "config.json")) as f:
        config = json.load(f)
    config["draft_vocab_size"] = len(ids)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for extra in ("target.json",):  # provenance travels with the head; the caller amends it
        if os.path.exists(os.path.join(head_dir, extra)) and os.path.abspath(head_dir) != os.path.abspath(out_dir):
            shutil.copy(os.path.join(head_dir, extra), os.path.join(out_dir, extra))
    return {
        "draft_vocab_before": len(have),
        "draft_vocab_after": len(ids),
        "added": len(add),
        "row_map_heldout_cosine_median": float(np.median(cos)),
    }

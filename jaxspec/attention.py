"""Attention over a per-slot KV cache with a compact mask description.

Query rows are T new tokens per slot whose KV was just written at cache columns
prefix_len[b] + offset + t. Visibility of cache column c for query row t:
  c < prefix_len[b]                         -> visible (the committed prefix)
  prefix_len[b] <= c < prefix_len[b] + W    -> local_mask[b, t, c - prefix_len[b]]  (the local region)
  otherwise                                 -> hidden
`local_mask=None` means causal: W = offset + T and row t sees the region up to its own column.
A verification tree passes its ancestor mask [B, N, N]; a draft tree step passes [B, k, W] over all
draft-tree tokens so far (DESIGN.md §5) — never a dense [B, N, S] mask.

Backends: "xla" (this file, the reference, any mask). Pallas kernels (issue 6) plug in here and
are checked against `attention_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("xla",)


def visibility(prefix_len, t: int, s: int, local_mask=None, sliding_window=None, offset=0):
    """Boolean [B, T, S] visibility of cache columns, as described in the module docstring."""
    col = jnp.arange(s)[None, None, :]  # [1, 1, S]
    rel = col - prefix_len[:, None, None]  # [B, 1, S]
    row = jnp.arange(t)[None, :, None]
    if local_mask is None:
        local = rel <= offset + row  # causal within the new block
    else:
        w = local_mask.shape[2]
        idx = jnp.broadcast_to(jnp.clip(rel, 0, w - 1), (rel.shape[0], t, s))
        local = (rel < w) & jnp.take_along_axis(local_mask, idx, axis=2)
    vis = (rel < 0) | local
    if sliding_window is not None:
        vis &= col > prefix_len[:, None, None] + offset + row - sliding_window
    return vis


def attention_reference(q, k, v, prefix_len, local_mask=None, sliding_window=None, offset=0, scale=None):
    """Pure-jnp attention.

    q: [B, T, H, D]; k, v: [B, S, Hkv, D]; prefix_len: [B] int32; local_mask: [B, T, W] bool or None.
    Returns [B, T, H, D] in q.dtype. Softmax is computed in float32.
    """
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    vis = visibility(prefix_len, t, s, local_mask, sliding_window, offset)  # [B, T, S]
    scores = jnp.where(vis[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def attention(q, k, v, prefix_len, local_mask=None, sliding_window=None, offset=0, backend: str = "xla"):
    if backend == "xla":
        return attention_reference(q, k, v, prefix_len, local_mask, sliding_window, offset)
    raise ValueError(f"unknown attention backend {backend!r}; available: {BACKENDS}")

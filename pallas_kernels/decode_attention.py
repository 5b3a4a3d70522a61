"""Decode attention: one query token per slot over its per-slot-length KV cache (flash-decoding), a
Pallas GPU kernel wrapper and its jnp reference.

Backend: Pallas on Triton, for the reasons given at the top of `tree_attention.py`.

Decode is the T = 1, causal case of the tree kernel, and it runs that same kernel body: the G query
heads of a KV head are packed into one program's rows (padded to 16), and the slot's visible columns
[0, kv_len) are split evenly across `splits` programs at run time, so a long context is read by many
SMs at once even at batch 1 (B * Hkv programs alone would leave most of an H100 idle: 8 for
Llama-3.1-8B). Keeping one body means one online-softmax and one split-merge to get right; what is
decode-specific is only the shape handling and the split count. The draft's top-k beams (several
queries with an ancestor mask) go through `tree_attention` directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.pallas_kernels.tree_attention import DEFAULT_BLOCKS, Blocks, tree_attention


def softmax_parts(scores, vis):
    """A masked softmax over the last axis, in the pieces a merge of several parts needs.
    scores [..., S] float32, vis bool broadcastable to it -> (p [..., S]: exp(scores - max) where
    visible, else 0; den [...]: the sum of p, 1 where nothing is visible; lse [...]: the
    log-sum-exp of the visible scores, -inf where nothing is visible). The softmax is p / den."""
    m = jnp.max(jnp.where(vis, scores, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(scores - m), 0.0)
    den = p.sum(axis=-1)
    seen = den > 0
    den = jnp.where(seen, den, 1.0)
    return p, den, jnp.where(seen, m[..., 0] + jnp.log(den), -jnp.inf)


def decode_attention_reference(q, k, v, kv_len, *, sliding_window=None, scale=None, return_lse=False):
    """Pure jnp. q: [B, H, D]; k, v: [B, S, Hkv, D]; kv_len: [B] int32, the visible columns [0, kv_len)
    (the query's own KV is the last of them). Returns [B, H, D] in q.dtype; softmax in float32. With
    return_lse: (out [B, H, D] float32, the log-sum-exps of the scaled scores [B, H] float32; -inf
    and a zero output for a row with no visible column)."""
    b, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, hkv, h // hkv, d)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
    col = jnp.arange(s)[None, :]
    vis = col < kv_len[:, None]  # [B, S]
    if sliding_window is not None:
        vis &= col >= kv_len[:, None] - sliding_window
    p, den, lse = softmax_parts(scores, vis[:, None, None])  # den, lse: [B, Hkv, G]
    out = jnp.einsum("bkgs,bskd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = (out / den[..., None]).reshape(b, h, d)
    if not return_lse:
        return out.astype(q.dtype)
    return out, lse.reshape(b, h)


@functools.partial(
    jax.jit,
    static_argnames=("sliding_window", "scale", "blocks", "interpret", "return_lse"),
)
def decode_attention(
    q,
    k,
    v,
    kv_len,
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    blocks: Blocks = DEFAULT_BLOCKS,
    interpret: bool = False,
    return_lse: bool = False,
):
    """q: [B, H, D]; k, v: [B, S, Hkv, D] (read in place); kv_len: [B] int32 visible columns.
    Returns [B, H, D] in q.dtype (with return_lse: out in float32 and the log-sum-exps [B, H] float32,
    -inf for an empty row). blocks: the tuning knobs, as `tree_attention`'s (block_r unused: one row)."""
    # The tree kernel's causal rule with one row: column c is visible iff c - prefix <= 0, i.e.
    # c < kv_len for prefix = kv_len - 1; its sliding-window rule c > prefix - window matches ours.
    out = tree_attention(
        q[:, None],
        k,
        v,
        kv_len - 1,
        None,
        sliding_window=sliding_window,
        scale=scale,
        blocks=blocks,
        interpret=interpret,
        return_lse=return_lse,
    )
    if return_lse:
        return out[0][:, 0], out[1][:, 0]
    return out[:, 0]

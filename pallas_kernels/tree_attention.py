"""Tree (verification) attention: T query tokens per slot over the slot's cached prefix plus a local
region seen through a compact mask — a Pallas GPU kernel, its jitted wrapper and its jnp reference.

Semantics (identical to `jaxspec.attention.attention_reference`): query row t of slot b sees cache column c
  c < kv_len[b]                        always (the committed prefix)
  kv_len[b] <= c < kv_len[b] + W       iff local_mask[b, t, c - kv_len[b]]  (the tree / draft region)
                                       (local_mask=None: causal, iff c - kv_len[b] <= offset + t)
  otherwise                            never
optionally limited to a sliding window. Verification passes the [B, N, N] ancestor mask of the draft
tree; EAGLE draft steps pass [B, topk, W] over all draft tokens so far. No dense [B, T, S] mask exists
anywhere: the kernel rebuilds visibility per KV block from kv_len, an iota and a [rows, block_k]
slice of the local mask.

Backend: Pallas on Triton (`jax.experimental.pallas.triton`), not Mosaic GPU. Reasons:
  * These are small-query, bandwidth-bound kernels (<= 64 tree tokens x GQA group rows per slot, one
    row for decode). Their speed is KV bytes per second; Mosaic GPU's WGMMA (64-row tiles) and
    warp-specialised TMA pipelines pay off for large-M matmuls, not here, while Triton's software
    pipelining of the K/V loads (`num_stages`) already streams at bandwidth.
  * Triton runs on every NVIDIA GPU our users serve on (A100, L4/L40S, RTX, H100/H200); Mosaic GPU
    needs sm_90+.
  * The body uses only generic Pallas ops (ref slicing with `pl.ds`, `lax.dot_general`, `fori_loop`),
    so the CPU interpreter (`interpret=True`) checks the very same body in CI, and a Mosaic GPU port
    (when Triton support is removed from JAX; it is deprecated since jax 0.11) keeps the same layout.

Layout. Queries are packed per KV head: row r = t * G + g of the GQA group, so one program reads each
K/V block once for all G query heads sharing it (the point of GQA). Grid (B, Hkv, row_blocks, splits):
the visible columns of a slot are split evenly (at run time, from kv_len) into `splits` parts
(flash-decoding), each program keeps an online softmax (m, l, acc) in float32, and `_combine` merges
the parts. K/V are read in place from the [B, S, Hkv, D] cache: no copy, no transpose. With one
row block (up to 64 packed rows, every decoding step and tree here) a program gathers its rows from
q [B, T, H, D] itself, the rows past the last repeating it (computed and discarded); with one split
as well (caches under 512 columns at batch 1, `default_splits`) it also normalises and writes its
rows of the output [B, T, H, D]: one kernel, where a pad or transpose before it and a merge after it
made three (a small model at batch 1 is bound by how many kernels a step launches).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG = -1e30  # finite "minus infinity": masked scores never produce inf - inf
TARGET_PROGRAMS = 132  # one wave of an H100's SMs
MIN_SPLIT_COLUMNS = 256  # fewer columns per split and the split-merge traffic (float32 partial
# outputs) starts to rival the K/V bytes it saves time on


def tree_attention_reference(q, k, v, kv_len, local_mask=None, *, offset=0, sliding_window=None, scale=None):
    """Pure jnp. q: [B, T, H, D]; k, v: [B, S, Hkv, D]; kv_len: [B] int32; local_mask: [B, T, W] bool
    or None (causal). Returns [B, T, H, D] in q.dtype; softmax in float32."""
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    col = jnp.arange(s)[None, None, :]
    rel = col - kv_len[:, None, None]  # [B, 1, S]
    row = jnp.arange(t)[None, :, None]
    if local_mask is None:
        local = rel <= offset + row
    else:
        w = local_mask.shape[2]
        idx = jnp.broadcast_to(jnp.clip(rel, 0, w - 1), (b, t, s))
        local = (rel < w) & jnp.take_along_axis(local_mask, idx, axis=2)
    vis = (rel < 0) | local  # [B, T, S]
    if sliding_window is not None:
        vis &= col > kv_len[:, None, None] + offset + row - sliding_window
    qg = q.reshape(b, t, hkv, h // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(vis[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def supported(q, k, local_mask=None) -> str | None:
    """None if the kernel handles these shapes, else the reason (the caller falls back to XLA)."""
    d, s = q.shape[-1], k.shape[1]
    if d not in (16, 32, 64, 128, 256):
        return f"head_dim {d} is not a power of two in [16, 256]"
    if s % 16:
        return f"cache length {s} is not a multiple of 16"
    if q.shape[2] % k.shape[2]:
        return "query heads do not divide by KV heads"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _kernel(
    kv_len_ref,
    pos_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    scale,
    block_k,
    group,
    num_rows,
    local_width,
    sliding_window,
    precision,
    block_r,
    clamp,
    final,
):
    """One program: rows [block_r] of one (slot, KV head), one split of the visible columns.

    kv_len_ref: [] int32; pos_ref: [] int32 = kv_len + offset, the cache column of query token 0; q_ref: [block_r, D]
    (clamp: the slot's whole q [T, H, D]); k_ref, v_ref: [S, D] (strided views of the cache);
    mask_ref (if local_width = W is set): [block_r, WP] int8, the local mask padded with block_k zero
    columns on the left and at least block_k on the right (WP >= W + 2 * block_k). Outputs acc_ref [block_r, D], m_ref, l_ref [block_r] (float32),
    or with `final` the slot's output [T, H, D] (and log-sum-exps [T, H]), this program's rows of it.
    """
    has_mask = local_width is not None
    mask_ref, outs = (rest[0], rest[1:]) if has_mask else (None, rest)
    d = q_ref.shape[-1]
    s_len = k_ref.shape[0]
    split, n_split = pl.program_id(3), pl.num_programs(3)
    row0 = pl.program_id(2) * block_r
    kv_len, pos0 = kv_len_ref[()], pos_ref[()]

    # packed row r = t * G + g; clamped: q_ref is the slot's whole q [T, H, D], row r is q[t, h * G + g]
    # of this program's KV head h, and rows past num_rows repeat the last
    ridx = jnp.minimum(lax.iota(jnp.int32, block_r), num_rows - 1) if clamp else None
    if clamp:
        t_idx, h_idx = ridx // group, pl.program_id(1) * group + ridx % group
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_r, block_k), 0)
    if clamp:
        rows = jnp.minimum(rows, num_rows - 1)
    t_of_row = rows // group
    if has_mask:
        hi = kv_len + local_width
    else:
        last_t = jnp.minimum(row0 + block_r - 1, num_rows - 1) // group
        hi = pos0 + last_t + 1  # causal: nothing right of the block's last row
    hi = jnp.minimum(hi, s_len)
    # This split's columns: [lo, lo + chunk) of [0, hi), chunk a multiple of block_k.
    chunk = pl.cdiv(pl.cdiv(hi, n_split), block_k) * block_k
    lo = split * chunk
    n_blocks = jnp.clip(pl.cdiv(hi - lo, block_k), 0, chunk // block_k)

    q = q_ref[t_idx, h_idx, :] if clamp else q_ref[...]
    col_iota = lax.broadcasted_iota(jnp.int32, (block_r, block_k), 1)

    def body(i, carry):
        acc, m, l = carry
        c0 = lo + i * block_k
        k = k_ref[pl.ds(c0, block_k), :]  # [block_k, D]
        v = v_ref[pl.ds(c0, block_k), :]
        sc = (
            lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
            * scale
        )  # [block_r, block_k]
        col = c0 + col_iota
        rel = col - kv_len
        if has_mask:
            # Local-mask columns [rel] live at padded column rel + block_k; blocks far from the
            # region clip into the zero padding on either side.
            start = jnp.clip(c0 - kv_len + block_k, 0, mask_ref.shape[1] - block_k)
            local = (mask_ref[:, pl.ds(start, block_k)] != 0) & (rel >= 0)
            vis = ((rel < 0) | local) & (col < hi)
        else:
            vis = (col <= pos0 + t_of_row) & (col < hi)  # the prefix and the causal region at once
        if sliding_window is not None:
            vis &= col > pos0 + t_of_row - sliding_window
        sc = jnp.where(vis, sc, NEG)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.where(vis, jnp.exp(sc - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [block_r, D]
        return acc * corr[:, None] + pv, m_new, l

    init = (
        jnp.zeros((block_r, d), jnp.float32),
        jnp.full((block_r,), NEG, jnp.float32),
        jnp.zeros((block_r,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(0, n_blocks, body, init)
    if final:  # the whole row in one program: normalise here (as _combine does for one part)
        seen = l > 0
        den = jnp.where(seen, l, 1.0)
        outs[0][t_idx, h_idx, :] = (acc / den[:, None]).astype(outs[0].dtype)
        if len(outs) > 1:
            outs[1][t_idx, h_idx] = jnp.where(seen, m + jnp.log(den), -jnp.inf)
        return
    acc_ref, m_ref, l_ref = outs
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _combine(acc, m, l):
    """Merges the splits' online-softmax states. acc: [..., P, R, D]; m, l: [..., P, R] ->
    (out [..., R, D], lse [..., R]: log of the softmax denominator, -inf for a row that saw nothing)."""
    m_all = m.max(axis=-2, keepdims=True)
    w = jnp.exp(m - m_all)  # [..., P, R]
    num = (acc * w[..., None]).sum(axis=-3)
    den = (l * w).sum(axis=-2)
    lse = jnp.where(den > 0, m_all[..., 0, :] + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
    return num / jnp.where(den > 0, den, 1.0)[..., None], lse


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernels' tuning knobs (static; hashable). block_k: KV columns per step (default 64, must
    divide the cache length); block_r: packed query rows per program (default: all rows up to 64);
    splits: parts the visible columns are split into (default: fill the GPU, `default_splits`);
    num_warps / num_stages: Triton's."""

    block_k: int | None = None
    block_r: int | None = None
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_BLOCKS = Blocks()


def default_splits(b: int, hkv: int, row_blocks: int, s: int) -> int:
    """Enough programs to fill the GPU, each split covering at least MIN_SPLIT_COLUMNS of a full cache."""
    want = pl.cdiv(TARGET_PROGRAMS, b * hkv * row_blocks)
    return int(max(1, min(want, s // MIN_SPLIT_COLUMNS, 64)))


@functools.partial(
    jax.jit,
    static_argnames=("sliding_window", "scale", "blocks", "interpret", "return_lse"),
)
def tree_attention(
    q,
    k,
    v,
    kv_len,
    local_mask=None,
    *,
    offset=0,
    sliding_window: int | None = None,
    scale: float | None = None,
    blocks: Blocks = DEFAULT_BLOCKS,
    interpret: bool = False,
    return_lse: bool = False,
):
    """q: [B, T, H, D]; k, v: [B, S, Hkv, D] (the cache, read in place); kv_len: [B] int32;
    local_mask: [B, T, W] bool or None (causal); offset: int32 scalar (may be traced), query token t
    sits at cache column kv_len + offset + t. Returns [B, T, H, D] in q.dtype. With return_lse:
    (out [B, T, H, D] float32, the rows' log-sum-exps of scaled scores [B, T, H] float32, -inf and a
    zero output where no column was visible), for merging with attention over other columns.
    blocks: the tuning knobs (`Blocks`; static).
    """
    block_k, block_r, splits = blocks.block_k, blocks.block_r, blocks.splits
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    scale = d**-0.5 if scale is None else scale
    if s % 16 or (block_k and s % block_k):
        raise ValueError(f"the cache length {s} must be a multiple of 16 and of block_k ({block_k})")
    block_k = block_k or next(c for c in (64, 32, 16) if s % c == 0)
    rows = t * group
    block_r = block_r or min(64, max(16, _pow2(rows)))
    r_pad = pl.cdiv(rows, block_r) * block_r
    row_blocks = r_pad // block_r
    splits = splits or default_splits(b, hkv, row_blocks, s)

    # One row block (the usual case: up to 64 packed rows) reads q unpadded, its rows past the
    # last clamped to the last (duplicates, computed and discarded), and with one split the kernel
    # writes the normalised output itself: no pad before the kernel and no merge after it, for a
    # decoding step one kernel instead of three.
    clamp = row_blocks == 1
    final = clamp and splits == 1
    if clamp:  # the kernel gathers its rows from q itself
        qp = q
        q_spec = pl.BlockSpec((None, t, h, d), lambda bi, hi, ri, si: (bi, 0, 0, 0))
    else:  # [B, T, Hkv, G, D] -> [B, Hkv, T*G (padded), D]: row r = t * G + g.
        qp = q.reshape(b, t, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, r_pad - rows), (0, 0)))
        q_spec = pl.BlockSpec((None, None, block_r, d), lambda bi, hi, ri, si: (bi, hi, ri, 0))
    kv_len = kv_len.astype(jnp.int32)
    inputs = [kv_len, kv_len + jnp.asarray(offset, jnp.int32), qp, k, v]
    in_specs = [
        pl.BlockSpec((None,), lambda bi, hi, ri, si: (bi,)),
        pl.BlockSpec((None,), lambda bi, hi, ri, si: (bi,)),
        q_spec,
        pl.BlockSpec((None, s, None, d), lambda bi, hi, ri, si: (bi, 0, hi, 0)),
        pl.BlockSpec((None, s, None, d), lambda bi, hi, ri, si: (bi, 0, hi, 0)),
    ]
    has_mask = local_mask is not None
    if has_mask:
        w = local_mask.shape[2]
        wp = _pow2(pl.cdiv(w, block_k) * block_k + 2 * block_k)
        mask = jnp.repeat(local_mask.astype(jnp.int8), group, axis=1)  # [B, T*G, W]
        # padded rows repeat the last row's mask (clamped rows are the last row)
        mask = jnp.pad(mask, ((0, 0), (0, r_pad - rows), (0, 0)), mode="edge")
        mask = jnp.pad(mask, ((0, 0), (0, 0), (block_k, wp - w - block_k)))
        inputs.append(mask)
        in_specs.append(pl.BlockSpec((None, block_r, wp), lambda bi, hi, ri, si: (bi, ri, 0)))

    kernel = functools.partial(
        _kernel,
        scale=scale,
        block_k=block_k,
        group=group,
        num_rows=rows,
        local_width=local_mask.shape[2] if has_mask else None,
        sliding_window=sliding_window,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT,
        block_r=block_r,
        clamp=clamp,
        final=final,
    )
    if final:
        return _final_call(kernel, inputs, in_specs, q, hkv, blocks, interpret, return_lse)
    stat = lambda bi, hi, ri, si: (bi, hi, si, ri)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_blocks, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, block_r, d), lambda bi, hi, ri, si: (bi, hi, si, ri, 0)),
            pl.BlockSpec((None, None, None, block_r), stat),
            pl.BlockSpec((None, None, None, block_r), stat),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, splits, r_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, r_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, r_pad), jnp.float32),
        ],
        compiler_params=_compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="tree_attention",
    )(*inputs)
    out, lse = _combine(acc, m, l)  # [B, Hkv, R, D], [B, Hkv, R]
    out = out[:, :, :rows].reshape(b, hkv, t, group, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
    if not return_lse:
        return out.astype(q.dtype)
    lse = lse[:, :, :rows].reshape(b, hkv, t, group).transpose(0, 2, 1, 3).reshape(b, t, h)
    return out, lse


def _final_call(kernel, inputs, in_specs, q, hkv: int, blocks: Blocks, interpret: bool, return_lse: bool):
    """One split, one row block: the kernel writes the output [B, T, H, D] (and the log-sum-exps
    [B, T, H]) itself, each program the rows of its KV head's query heads."""
    b, t, h, d = q.shape
    out_specs = [pl.BlockSpec((None, t, h, d), lambda bi, hi, ri, si: (bi, 0, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, t, h, d), jnp.float32 if return_lse else q.dtype)]
    if return_lse:
        out_specs.append(pl.BlockSpec((None, t, h), lambda bi, hi, ri, si: (bi, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, t, h), jnp.float32))
    res = pl.pallas_call(
        kernel,
        grid=(b, hkv, 1, 1),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="tree_attention",
    )(*inputs)
    return tuple(res) if return_lse else res[0]


def _compiler_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)

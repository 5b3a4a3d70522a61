"""The accepted path of a verification tree made contiguous in every layer's KV cache at once: one
Pallas GPU kernel for all layers, its jitted wrapper and its jnp reference.

After a speculation round, the KV of the accepted tree nodes sits at columns lengths + path[:, i];
it moves to lengths + i. Done per layer with XLA that is a gather and a scatter for K and for V:
4 kernels a layer, 120 of a SmolLM2 round's. Here one kernel moves them all, in place (the buffers
are aliased to the outputs), one program per slot: it reads a layer's T source columns whole, then
writes them, so a column that is both read and written is read first, as the gather-then-scatter
does. Columns past the cache's end are not written (as a scatter with mode="drop"), and sources
past it are clamped (as a gather's indices are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def commit_reference(bufs, slots, src, dst):
    """Pure jnp. bufs: tuple of [Bfull, S, Hkv, D]; slots: [B] buffer rows; src, dst: [B, T] columns.
    Returns bufs with buf[slots[b], dst[b, i]] = buf[slots[b], src[b, i]]."""
    rows = slots[:, None]
    return tuple(x.at[rows, dst].set(x[rows, jnp.clip(src, 0, x.shape[1] - 1)], mode="drop") for x in bufs)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("bufs",))
def commit(bufs, slots, src, dst, *, interpret: bool = False):
    """`commit_reference`'s contract in one kernel, the buffers updated in place (donated)."""
    b, t = src.shape
    s, hkv, d = bufs[0].shape[1:]
    full = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
    n = len(bufs)
    inputs = [slots.astype(jnp.int32), src.astype(jnp.int32), dst.astype(jnp.int32), *bufs]
    kernel = functools.partial(_kernel, n=n, t=t, s=s, hkv=hkv, d=d)
    return tuple(
        pl.pallas_call(
            kernel,
            grid=(b,),
            in_specs=[full(x) for x in inputs],
            out_specs=[full(x) for x in bufs],
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in bufs],
            input_output_aliases={3 + i: i for i in range(n)},
            compiler_params=_compiler_params(),
            interpret=interpret,
            name="kv_commit",
        )(*inputs)
    )


def _kernel(slots_ref, src_ref, dst_ref, *refs, n, t, s, hkv, d):
    from jax.experimental.pallas import triton as pltriton

    outs = refs[n:]
    bi = pl.program_id(0)
    tp, lanes = _pow2(t), _pow2(hkv * d)
    # every index an array [T', L'] (powers of two): column i, lane l = head * D + dim; the indices past
    # T and Hkv * D are clamped to the last, so those lanes repeat a live lane's move exactly (the
    # same value to the same place: harmless, and no masked lane shares a live lane's address,
    # which the interpreter would write back with its old value)
    i = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (tp, lanes), 0), t - 1)
    lane = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (tp, lanes), 1), hkv * d - 1)
    head, dim = lane // d, lane % d
    row = jnp.full((tp, lanes), slots_ref[bi], jnp.int32)
    src_cols = jnp.clip(pltriton.load(src_ref.at[jnp.full((tp, lanes), bi, jnp.int32), i]), 0, s - 1)
    dst_cols = pltriton.load(dst_ref.at[jnp.full((tp, lanes), bi, jnp.int32), i])
    keep = dst_cols < s  # (a round's scratch region fits the cache: nothing is dropped in practice)
    dst_cols = jnp.minimum(dst_cols, s - 1)
    for ref in outs:
        vals = pltriton.load(ref.at[row, src_cols, head, dim])
        pltriton.store(ref.at[row, dst_cols, head, dim], vals, mask=keep)


def _compiler_params():
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=1)

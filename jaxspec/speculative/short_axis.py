"""Reductions over a short static last axis (a tree's N nodes, a node's k children, a round's
emitted tokens) written as elementwise operations on its slices.

On a GPU, XLA emits every reduction as a kernel of its own, and whatever consumes it as another:
a walk down the tree that takes `jnp.any` / `jnp.argmax` over N nodes at each step costs two or
three launches a step for a few bytes of work. Unrolled over the axis, the same logic has no
reduction in it, so XLA fuses a whole chain of such steps into one kernel. Results equal the
jnp functions' (the running sum adds in index order, as a sequential loop does).

The same holds at the other end: XLA:GPU reduces a row of up to ROW_BLOCK entries in one kernel
and splits a longer one (a vocabulary of 49,152 or 128,256) into two kernels, the second a
reduction over a few partial results. `row_sum` and `row_argmax` reduce such rows in blocks of
at most ROW_BLOCK (one kernel) and combine the few blocks elementwise, where the consumer fuses
them. On CPU they are jnp.sum / jnp.argmax, unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec import compile_target

ROW_BLOCK = 16384  # XLA:GPU's longest row reduced in one kernel (longer ones are split in two)


def any_of(x):
    """x [..., n] bool -> [...]: jnp.any(x, -1)."""
    return functools.reduce(jnp.logical_or, [x[..., i] for i in range(x.shape[-1])])


def first_true(x):
    """x [..., n] bool -> int32 [...]: the first index where x holds, 0 where none does
    (jnp.argmax(x, -1))."""
    idx = jnp.zeros(x.shape[:-1], jnp.int32)
    for i in reversed(range(x.shape[-1])):
        idx = jnp.where(x[..., i], i, idx)
    return idx


def running_sum(x):
    """x [..., n] -> [..., n]: jnp.cumsum(x, -1), added in index order."""
    acc = [x[..., 0]]
    for i in range(1, x.shape[-1]):
        acc.append(acc[-1] + x[..., i])
    return jnp.stack(acc, -1)


def _blocks(x, fill):
    """x [..., V] -> ([..., c, size] padded with fill, size): c = ceil(V / ROW_BLOCK) blocks."""
    v = x.shape[-1]
    c = -(-v // ROW_BLOCK)
    size = -(-v // c)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, c * size - v)], constant_values=fill)
    return x.reshape(*x.shape[:-1], c, size), size


def _one_kernel(x) -> bool:
    return x.shape[-1] <= ROW_BLOCK or compile_target.platform() == "cpu"


def row_sum(x, keepdims: bool = False):
    """x [..., V] -> [...] (or [..., 1]): jnp.sum(x, -1), one kernel on a GPU at any V."""
    if _one_kernel(x):
        return jnp.sum(x, -1, keepdims=keepdims)
    b, _ = _blocks(x, 0)
    part = jnp.sum(b, -1)  # [..., c]
    total = functools.reduce(jnp.add, [part[..., i] for i in range(part.shape[-1])])
    return total[..., None] if keepdims else total


def row_argmax(x):
    """x [..., V] -> int32 [...]: jnp.argmax(x, -1) (the first maximal index, a NaN counting as
    maximal), one kernel on a GPU at any V."""
    if _one_kernel(x):
        return jnp.argmax(x, -1).astype(jnp.int32)
    return row_max_argmax(x)[1]


def row_max_argmax(x):
    """x [..., V] -> (x at jnp.argmax(x, -1) [...], that index int32 [...]) from one (value, index)
    reduction: one kernel on a GPU at any V, where the value read back at the index is another.
    (On a CPU, where XLA runs such a reduction an element at a time, sampling.max_argmax has its own.)"""
    v = x.shape[-1]
    b, size = _blocks(x, -jnp.inf) if v > ROW_BLOCK else (x[..., None, :], v)
    iota = jax.lax.broadcasted_iota(jnp.int32, b.shape, b.ndim - 1)
    val, idx = jax.lax.reduce((b, iota), (jnp.array(-jnp.inf, b.dtype), jnp.int32(size)), _first_max, (b.ndim - 1,))
    best_v, best_i = val[..., 0], idx[..., 0]
    for i in range(1, val.shape[-1]):  # a later block wins only with a strictly larger value (or the first NaN)
        v = val[..., i]
        take = (v > best_v) | (jnp.isnan(v) & ~jnp.isnan(best_v))
        best_v, best_i = jnp.where(take, v, best_v), jnp.where(take, idx[..., i] + i * size, best_i)
    return best_v, best_i


def _first_max(a, b):
    """argmax's reduction step on (value, index) pairs: the larger value, a NaN above all, the
    smaller index among equals. Its identity (-inf, size) loses to every pair of a real index."""
    (av, ai), (bv, bi) = a, b
    a_nan, b_nan = jnp.isnan(av), jnp.isnan(bv)
    same = (av == bv) | (a_nan & b_nan)
    take_b = (b_nan & ~a_nan) | ((bv > av) & ~a_nan) | (same & (bi < ai))
    return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

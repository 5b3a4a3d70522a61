"""Reductions over a short static last axis (a tree's N nodes, a node's k children, a round's
emitted tokens) written as elementwise operations on its slices.

On a GPU, XLA emits every reduction as a kernel of its own, and whatever consumes it as another:
a walk down the tree that takes `jnp.any` / `jnp.argmax` over N nodes at each step costs two or
three launches a step for a few bytes of work. Unrolled over the axis, the same logic has no
reduction in it, so XLA fuses a whole chain of such steps into one kernel. Results equal the
jnp functions' (the running sum adds in index order, as a sequential loop does).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp


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

"""How many request slots fit: device memory (host RAM on CPU) x --mem-fraction-static, minus the
weights, divided by what one slot holds (its KV cache for the whole context, plus draft state)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxspec.errors import JaxspecError

logger = logging.getLogger("jaxspec.server")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int  # per device
    source: str  # where total_bytes comes from
    weights_bytes: int  # target + draft, per device
    slot_bytes: int  # one request slot, per device
    slots: int


def memory_budget() -> tuple[int, str]:
    """(bytes the device can hold, where the figure comes from)."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{dev.platform} memory pool"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


def nbytes(tree: Any) -> int:
    """Bytes one device holds of the arrays (or shapes) in tree."""

    def size(x):
        s = getattr(x, "sharding", None)
        n = int(np.prod(x.shape if s is None else s.shard_shape(x.shape)))
        return n * (8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.dtype(x.dtype).itemsize)

    return sum(size(x) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))


def plan_slots(
    one_slot: Callable[[], Any],
    kv_of: Callable[[Any], Any],
    weights: Any,
    tp_size: int,
    context_length: int,
    requested: int | None,
    fraction: float,
    gpu: bool,
) -> MemoryPlan:
    """one_slot(): the state of one slot (traced with eval_shape, never allocated); kv_of(state):
    its target KV cache (split tp_size ways); weights: every parameter pytree on the device.
    requested: --max-running-requests (None: what fits, at most 64 on GPU and 8 on CPU)."""
    if not 0 < fraction <= 1:
        raise JaxspecError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
    one = jax.eval_shape(one_slot)
    kv = nbytes(kv_of(one))
    per_slot = nbytes(one) - kv + kv // tp_size  # eval_shape drops shardings; the target's KV is split tp ways
    w = nbytes(weights)
    total, where = memory_budget()
    budget = int(total * fraction) - w
    fits = budget // per_slot if budget > 0 else 0
    gib = lambda x: f"{x / 2**30:.2f} GiB"
    plan = (
        f"per device: {where} {gib(total)} x mem_fraction_static {fraction} = {gib(total * fraction)}; weights (target + draft) "
        f"{gib(w)}; one request slot (KV cache for context_length {context_length} + draft state) {gib(per_slot)}"
    )
    if fits < 1:
        raise JaxspecError(
            f"out of memory: not even one request slot fits. {plan}. Try: a smaller --context-length, fewer "
            "--max-running-requests, a smaller speculative tree (--speculative-num-draft-tokens / --speculative-eagle-topk), "
            "--dtype bfloat16, or a higher --mem-fraction-static"
        )
    cap = requested if requested is not None else (64 if gpu else 8)
    if cap < 1:
        raise JaxspecError("--max-running-requests must be >= 1")
    slots = int(min(cap, fits))
    if requested is not None and requested > fits:
        logger.warning("--max-running-requests %d does not fit; serving %d slots (%s)", requested, slots, plan)
    logger.info("memory plan: %s -> %d slots", plan, slots)
    return MemoryPlan(total, where, w, per_slot, slots)

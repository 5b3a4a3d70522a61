"""How many request slots fit: device memory (host RAM on CPU) x --mem-fraction-static, minus the
weights, divided by what one slot holds (its KV cache for the whole context, plus draft state).

On a CPU the KV cache is host memory that a request only touches column by column, so its pages
are handed back to the kernel while they hold nothing: the whole cache while every slot is free
and empty (`release_pages`), and a finished request's slot past the prefix it keeps cached
(`release_columns`). The process's resident memory then grows with the columns requests and
cached prefixes hold, not with slots x context. The other
large share of a CPU server's memory is its compiled programs (tens of MB each, measured at
start-up: `ProgramMemory`), which the server bounds by a budget (server/programs.py)."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
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


def map_usage() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's limit), or None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return used, int(f.read())
    except (OSError, ValueError):
        return None


MADV_DONTNEED = 4  # Linux: anonymous private pages read back as zeros until written again


def release_pages(arrays) -> int:
    """Hands the whole memory pages inside each CPU array's buffer back to the kernel (Linux
    madvise MADV_DONTNEED): they read as zeros again and take no memory until written. Only for
    arrays whose contents do not matter or are zeros (free slots' KV caches); blocks until every
    computation writing them is done. Returns the bytes released (0 where not supported)."""
    return _release(arrays, lambda shape, itemsize: [(0, int(np.prod(shape)) * itemsize)], wait=True)


def release_columns(arrays, slot: int, col: int) -> int:
    """release_pages for the columns [col, S) of one slot of each array [B, S, ...] (a KV buffer):
    only the whole pages inside that slot's tail, so the columns before `col` keep their
    contents. For a free slot whose columns from `col` on hold nothing anyone will read (past the
    prefix it keeps cached). It does not wait for a computation in flight: one may still read
    that tail (reading zeros, where nothing it needs lives) or write a done slot's padding
    columns there (the pages written are taken again, nothing else changes)."""

    def tail(shape, itemsize):
        b, s = shape[0], shape[1]
        if not 0 <= slot < b or col >= s:
            return []
        row = int(np.prod(shape[2:])) * itemsize  # bytes per column
        return [((slot * s + max(col, 0)) * row, (slot + 1) * s * row)]

    return _release(arrays, tail, wait=False)


def _release(arrays, ranges, wait: bool) -> int:
    """madvise(MADV_DONTNEED) over the whole pages inside each byte range [start, end) of each CPU
    array's buffer that ranges(shard shape, itemsize) lists, after the computations writing the
    array are done if `wait`. Returns the bytes released."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    done = 0
    for x in arrays:
        if any(d.platform != "cpu" for d in x.devices()):
            return done
        if wait:
            jax.block_until_ready(x)
        for shard in x.addressable_shards:
            data = shard.data
            ptr = data.unsafe_buffer_pointer()
            for lo, hi in ranges(data.shape, data.dtype.itemsize):
                start, end = -(-(ptr + lo) // page) * page, (ptr + hi) // page * page
                if (
                    end - start >= page
                    and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0
                ):
                    done += end - start
    return done


def trim_heap() -> None:
    """Returns the C heap's free memory to the kernel (glibc malloc_trim): an XLA compile leaves
    tens of MB per program free but held in malloc's arenas."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """The process's resident memory (0 where /proc does not say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# Programs that calls asked for may take up to this many times the programs' budget: a call served
# through a program for more slots than it runs costs up to twice its own (a batch of 4 through the
# start-up program for 8 slots), while the background list's other shapes are guesses at what calls
# may need. 1 keeps them within the budget (less memory, slower batches).
WANTED_MEMORY = 2


@dataclasses.dataclass
class ProgramMemory:
    """What compiled programs take: measured over the start-up compiles (resident memory before and
    after, the heap trimmed), and the budget background compiles stay within."""

    budget_bytes: int  # compiled programs may take this much host memory in all
    per_program: int = 0  # measured at start-up (0: not measured yet)
    startup: int = 0  # programs compiled at start-up
    background: int = 0  # programs compiled since

    @property
    def count(self) -> int:
        return self.startup + self.background

    @property
    def bytes(self) -> int:
        return self.count * self.per_program

    def room(self, wanted: bool = False) -> bool:
        """Whether one more program fits the budget; wanted: a program calls asked for (the exact
        size of calls a larger program served), which may take the process up to WANTED_MEMORY
        times the budget."""
        cap = self.budget_bytes * (WANTED_MEMORY if wanted else 1)
        return self.per_program == 0 or (self.count + 1) * self.per_program <= cap


def program_budget() -> int:
    """Host memory compiled programs may take: a tenth of host RAM, at most 2.5 GiB."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(ram // 10, int(2.5 * 2**30))

"""The scheduler's state and what keeps it whole: the request slots on the device (planned to fit
memory), the queue and the running requests on the host, and recovery from a failed device call.

`SchedulerState` is the base of the scheduler (server/scheduler.py): admission
(server/admission.py) and dispatch (server/dispatch.py) extend it with their steps of the loop.
`lock` guards the host state (waiting, busy, the prefix cache, stats, cancellations); the device
state (`batch`) belongs to the scheduler thread.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compile_target, grammar
from jaxspec.cache import KVCache
from jaxspec.config import SpecConfig
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.logprobs import top_k_for
from jaxspec.sampling import skips_unused
from jaxspec.server.memory import MemoryPlan, map_usage, plan_slots, release_columns, release_pages, rss_bytes
from jaxspec.server.nodes import Nodes
from jaxspec.server.prefix_cache import PrefixCache
from jaxspec.server.programs import Programs
from jaxspec.server.records import Pending, PrefillGroup, Request, Stats
from jaxspec.serving import SlotBatch
from jaxspec.speculative.adaptive import SERVER_MARGIN, SERVER_PRIOR_ROUNDS, Adaptive, shape_label
from jaxspec.speculative.loop import SpecState
from jaxspec.speculative.online import feature_window, read_features
from jaxspec.speculative.proposers.eagle import EagleProposer

logger = logging.getLogger("jaxspec.server")


def dispatch_defaults(platform: str) -> tuple[int, int]:
    """(rounds per dispatch, smallest KV span a program reads) on `platform` unless flags say otherwise.
    A GPU runs 8 rounds per dispatch (one CUDA graph each) over spans of 512 and up: long spans cost
    little there and mean fewer programs, while on a CPU attention over unused columns is a visible
    share of a decode step (27 vs 32 tok/s), and 2 rounds keep a dispatch short."""
    return (8, 512) if platform != "cpu" else (2, 64)


class SchedulerState:
    def __init__(
        self,
        eng: Engine,
        max_running_requests: int | None = None,
        mem_fraction_static: float = 0.8,
        max_queued_requests: int = 256,
        decode_steps: int | None = None,
        overlap: bool = True,
        min_span: int | None = None,
        prefix_cache: bool = True,
        nodes: Nodes | None = None,
    ):
        self.eng = eng
        # several hosts (server/nodes.py): node 0's device calls are repeated on the others
        self.nodes = nodes
        if nodes is not None:
            nodes.sched = self
        # the shortest prefix worth a copy (or a wait for a prompt being prefilled): one small chunk
        self.cache = PrefixCache(prefix_cache, min_reuse=min(64, eng.chunked_prefill_size))
        # one tree shape for every dispatch: on CPU the server's programs sample (they serve greedy
        # calls too, at no extra cost), so they run the shape of rounds that sample (SpecConfig.for_kind)
        self.spec = eng.spec.for_kind(skips_unused()) if eng.spec.enabled else None
        self.prop = eng.proposer if self.spec else None
        gpu = compile_target.platform() != "cpu"
        default_k, default_span = dispatch_defaults(compile_target.platform())
        self.k = int(decode_steps or default_k)  # rounds per dispatch
        # adaptive speculation: per dispatch, the tree shape or plain steps (its own cost table:
        # a dispatch's rounds are not the offline engine's programs)
        self.adaptive = (
            Adaptive(self.spec, SERVER_MARGIN, self.k, prior_rounds=SERVER_PRIOR_ROUNDS, retry_all=True)
            if self.spec and self.spec.adaptive
            else None
        )
        # label -> tree shape of each dispatch kind (server/program_shapes.py): the configured one first
        cands = self.adaptive.candidates if self.adaptive else [self.spec]
        self.shapes: dict[str, SpecConfig | None] = {shape_label(c): c for c in cands}
        self.main_shape = shape_label(self.spec)
        self.min_span = int(min_span or default_span)  # smallest KV span a program reads
        if self.k < 1:
            raise JaxspecError("--num-continuous-decode-steps must be >= 1")
        steps = self.spec.depth if self.spec else 0
        self.window = self.k * (steps + 1)
        # KV columns a round of the server's shape writes past a request's last token
        self.scratch = self.spec.scratch_tokens if self.spec else 0
        self.context_length = eng.context_length
        self.max_len = -(-(self.context_length + self.scratch) // 64) * 64
        self.num_stop = 8
        # constrained decoding: slots carry grammar handles, and programs mask by them on demand
        # (host callbacks; not under tensor parallelism, where requests with a grammar are refused)
        self.grammar = eng.tp_size == 1
        self._slot_handle: dict[int, int] = {}  # slot -> the matcher handle of its latest request
        self.finished_slots: list[int] = []  # slots freed since the last release_tails()
        # online draft training (scheduler thread): slot -> (the read of its finished request's target
        # features, the end of the columns it uses); those pages are not handed back before the read is done
        self.feature_reads: dict[int, tuple[jax.Array, int]] = {}
        self.overlap = overlap
        self.max_queued = max_queued_requests
        self.slots = self._plan_memory(max_running_requests, mem_fraction_static, gpu)
        if nodes is not None:  # every node has node 0's slots, whatever its own memory allows
            self.slots = nodes.agree("slots", self.slots)
        self.batch = self._new_batch(self.slots)
        self.release_kv()
        if eng.online is not None:  # online training's feature read compiles now, not at the first finish
            layer = self.feature_layer()
            zero = jnp.int32(0)
            read_features(layer, zero, zero, size=feature_window(0, layer.shape[1])[1]).block_until_ready()
        self.busy: dict[int, Request] = {}  # slot -> request (prefilling or decoding)
        # admission groups with prompt chunks left
        self._prefilling: collections.deque[PrefillGroup] = collections.deque()
        self.waiting: collections.deque[Request] = collections.deque()
        self.stats = Stats()
        self.lock = threading.Lock()  # waiting, busy, stats, cancellations
        self.wake = threading.Condition(self.lock)
        self.tok_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        self._pending: collections.deque[Pending] = collections.deque()
        self._rng = np.random.default_rng(0)
        self._seq = 0  # device calls enqueued so far (prefill chunks, admissions, dispatches)
        self._admit_seq = 0  # the last prefill chunk, admission or prefix copy among them
        self._last_fetched = (-1, 0.0)  # (seq, time) of the latest device call whose results arrived
        self._stop = False
        self._thread: threading.Thread | None = None
        self.programs = Programs(self, lazy=True)  # server/launch.py compiles ahead and sets lazy=False
        self.error: str | None = None  # set when the scheduler could not recover: the server is down
        self.recovering = False  # True while the device state is being re-created
        self._last_busy = 0.0  # when idle_for last saw a request
        self._last_step = 0.0  # when the scheduler thread last ran a step
        self.last_recovery: str | None = None  # why the device state was last re-created

    # ---- memory plan -------------------------------------------------------------------------

    def _plan_memory(self, requested: int | None, fraction: float, gpu: bool) -> int:
        eng = self.eng
        plan = plan_slots(
            lambda: self._new_batch(1, sharded=False),
            lambda one: (one.core.cache.k, one.core.cache.v),
            (eng.params, eng.dparams if self.spec else None),
            eng.tp_size,
            self.context_length,
            requested,
            fraction,
            gpu,
        )
        self.memory_plan: MemoryPlan = plan
        return plan.slots

    def _kv_arrays(self, batch: SlotBatch | None = None) -> list[jax.Array]:
        """The KV buffers of the target's and the draft's caches (of `batch`, default the slots')."""
        batch = self.batch if batch is None else batch
        caches = jax.tree_util.tree_leaves(batch.core, is_leaf=lambda x: isinstance(x, KVCache))
        return [a for c in caches if isinstance(c, KVCache) for a in c.k + c.v]

    def feature_layer(self) -> jax.Array:
        """The slots' draft-cache layer of kept target features [B, S, 1, F] (online draft training)."""
        core, prop = self.batch.core, self.prop
        assert isinstance(core, SpecState) and isinstance(prop, EagleProposer) and prop.keep_features
        return core.draft.cache.k[prop.feature_layer]

    def release_tails(self) -> int:
        """(scheduler thread, lock not held) Hands back the KV pages of the slots whose requests
        finished since the last call, past the prefix each keeps cached (`finished_slots`, filled by
        the finishing code with the lock held). Called before the next admission, so that no slot
        is taken meanwhile; a dispatch still in flight is not waited for (server/memory.py
        release_columns). Returns the bytes released."""
        with self.lock:
            todo, self.finished_slots = self.finished_slots, []
            cols = {s: self.cache.held_length(s) for s in todo if s not in self.busy}
            # one column more than the prefix: the draft's entry for a position is written one step later
            cols = {s: c + 1 if c else 0 for s, c in cols.items()}
            reads = {s: self.feature_reads.pop(s) for s in todo if s in self.feature_reads}
        for s, (read, end) in reads.items():
            if s in cols and end > cols[s]:  # the pages it reads would be handed back under it
                read.block_until_ready()
        if not cols or self.batch is None:
            return 0
        arrays = self._kv_arrays()
        return sum(release_columns(arrays, s, c) for s, c in cols.items())

    def release_kv(self) -> int:
        """Hands the KV caches' pages back to the kernel (server/memory.py release_pages): only
        while every slot is free and holds no cached prefix (their contents no longer matter), and
        no device call is in flight. Returns the bytes released."""
        reads, self.feature_reads = list(self.feature_reads.values()), {}
        for read, _ in reads:  # online draft training's reads of finished requests' features
            read.block_until_ready()
        return release_pages(self._kv_arrays())

    def memory_report(self) -> dict[str, Any]:
        """What the server's memory holds (bytes): weights, the KV cache as allocated (on a CPU its
        pages are taken only as requests write columns), compiled programs (measured at start-up)
        and their budget, and the process's resident memory and memory maps now."""
        plan, progs = self.memory_plan, self.programs.memory
        maps = map_usage()
        batch = self.batch  # None for a moment while the slots are re-created
        kv = None if batch is None else sum(a.nbytes for a in self._kv_arrays(batch)) // max(self.eng.tp_size, 1)
        return {
            "weights_bytes": plan.weights_bytes,
            "kv_cache_bytes": kv,
            "slots": self.slots,
            "context_length": self.context_length,
            "programs": progs.count,
            "program_bytes": progs.bytes,
            "program_budget_bytes": progs.budget_bytes,
            "resident_bytes": rss_bytes(),
            "memory_maps": None if maps is None else maps[0],
        }

    def _new_batch(self, slots: int, sharded: bool = True) -> SlotBatch:
        """Empty device slots. Every emitted token's logprob and its top alternatives (jaxspec/logprobs.py)
        are computed (a top-k over the vocabulary per token: cheap next to the model); the host
        reads them only for requests that asked."""
        eng = self.eng
        return SlotBatch.create(
            eng.cfg,
            self.prop,
            slots,
            self.max_len,
            self.window,
            self.num_stop,
            eng.dtype,
            self.spec.depth if self.spec else 0,
            eng.kv_sharding if sharded else None,
            top_logprobs=top_k_for(eng.cfg.vocab_size),
            grammar=self.grammar,
        )

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.busy)

    def forget(self, rows, col: int) -> None:
        """The slots `rows` are overwritten from column `col` on (a program run on free slots):
        their cached prefixes are cut (server/prefix_cache.py PrefixCache.forget)."""
        with self.lock:
            self.cache.forget(rows, col)

    # ---- failures ----------------------------------------------------------------------------

    def _guarded(self, what: str, reqs: list[Request], fn) -> bool:
        """fn(); on an exception fails `reqs` (and, if the device state is gone, every running request). True if fn succeeded."""
        try:
            fn()
            return True
        except Exception as e:
            logger.exception("error while %s (%d requests)", what, len(reqs))
            msg = f"internal error while {what}: {type(e).__name__}: {e}"
            for r in reqs:
                self._fail(r, msg)
            if not self._state_ok():
                self._recover(msg)
            return False

    def _state_ok(self) -> bool:
        """Whether the device state survived (no buffer donated to a failed program, none poisoned)."""
        try:
            if any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.batch)):
                return False
            jax.block_until_ready(self.batch)
            return True
        except Exception:
            return False

    def _recover(self, why: str) -> None:
        """Re-creates the slot state: every request holding a slot fails, waiting ones stay queued."""
        logger.error("device state lost (%s): failing the running requests and re-creating the request slots", why)
        self.recovering = True
        try:
            with self.lock:
                running = list(self.busy.values()) + [r for g in self._prefilling for r in g.reqs]
            for r in running:
                self._fail(r, f"internal error (the server recovered; retry the request): {why}")
            with self.lock:
                self.busy.clear()
                self._prefilling.clear()
                self._pending.clear()
            with self.lock:
                self.cache.flush()
            if self.nodes is not None:
                self.nodes.tell_recreate()
            self.recreate_slots()
            with self.lock:
                self.stats.recoveries += 1
            self.last_recovery = why
        finally:
            self.recovering = False

    def recreate_slots(self) -> None:
        """New, empty request slots on the device (the old ones are dropped first)."""
        self.batch = None  # type: ignore[assignment]  # (memory_report meanwhile reports no KV cache)
        self.batch = self._new_batch(self.slots)
        self.release_kv()

    def _fail(self, r: Request, message: str) -> None:
        """Ends one request with an "error" event and frees its slot."""
        with self.lock:
            if r.finished:
                return
            r.finished = True
            if r in self.waiting:
                self.waiting.remove(r)
            if self.busy.get(r.slot) is r:
                del self.busy[r.slot]
            if not r.cancelled:
                self.stats.failed += 1
            self._close_grammar(r)
        r.send({"type": "error", "message": message})

    def _close_grammar(self, r: Request) -> None:
        """(lock held) Drops a finished request's matcher (its slot may still run a dispatch with
        the handle: an unknown handle masks nothing, and the slot is stopped)."""
        if r.handle >= 0:
            grammar.close_handle(r.handle)
            if self._slot_handle.get(r.slot) == r.handle:
                self._slot_handle.pop(r.slot, None)  # (cancel runs on another thread than admission)
            r.handle = -1

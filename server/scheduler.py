"""Continuous batching on the host: a bounded wait queue, slot allocation, streaming, cancellation.

One scheduler thread owns the device state (jaxspec/serving.py `SlotBatch`) and loops:
  admit     waiting requests take free slots (the lowest, or one holding their prompt's prefix),
            in power-of-two groups; a cached prefix is reused (prefix caching, below)
  prefill   prompt chunks up to --chunked-prefill-size tokens per iteration while others decode
            (all of a group's chunks when nothing decodes), then each group's first tokens
  dispatch  k rounds for the decoding slots (one compiled program); every other slot is stopped.
            With adaptive speculation, plain steps instead when they are expected to be faster
  process   fetch a dispatch's new tokens, detokenize, stream them, finish requests, free their slots
With overlap on (the default), dispatch i + 1 is enqueued before dispatch i's results are fetched,
so host work (detokenizing, streaming, admitting) runs while the device computes (JAX async
dispatch; SGLang's overlap scheduler). Requests talk to the thread through `Request.emit`, a
callback the HTTP layer points at its asyncio queue.

Prefix caching (on unless --disable-radix-cache): a finished request's slot keeps its KV (target
and draft) while free, and the host remembers which tokens it holds. A new request reuses the
longest prefix of its prompt held by a free slot or by a decoding request's prompt: it takes that
free slot as it is, or the prefix's KV columns are copied into its own slot (one device copy,
`copy_prefix`), and only the rest of the prompt is prefilled. A request whose prompt shares a
longer prefix with one still being prefilled waits for it, so that concurrent requests with a
common system prompt compute it once. Free slots are the cache: a slot is evicted (least recently
used first) when a request needs it, so the cache never fails or delays a request. Why copies
into contiguous slots rather than paged KV: both attention backends read one contiguous region
per slot, and a copy of a prefix costs far less than prefilling it (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import grammar
from jaxspec.cache import KVCache
from jaxspec.config import SpecConfig
from jaxspec.decode import LENGTH, STOPPED
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.logprobs import top_k_for
from jaxspec.requests import (
    bucket,
    check_prompt,
    check_stop_token_ids,
    common_prefix,
    draft_prompt,
    finish_reason,
    logprob_rows,
    make_result,
    output_logprobs,
    stop_token_ids,
)
from jaxspec.sampling import SamplingParams, SamplingTensors, any_sampled, skips_unused
from jaxspec.serving import SlotBatch
from jaxspec.speculative.adaptive import OFF, SERVER_MARGIN, Adaptive, shape_label
from server.detokenize import DetokState, detokenize
from server.memory import MemoryPlan, map_usage, plan_slots, release_pages, rss_bytes, trim_heap
from server.programs import Programs

logger = logging.getLogger("jaxspec.server")


class QueueFull(Exception):
    """The wait queue is at --max-queued-requests."""


@dataclasses.dataclass(eq=False)
class Request:
    ids: list[int]  # prompt token ids
    params: SamplingParams
    emit: Callable[[dict], None]  # called from the scheduler thread: {"type": "delta" | "done" | "error", ...}
    speculative: bool = True  # False: this request decodes without speculation
    top_logprobs: int | None = None  # report each output token's logprob with this many alternatives
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # filled by the scheduler
    max_new: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled: their KV came from the prefix cache
    out_ids: list[int] = dataclasses.field(default_factory=list)
    # with top_logprobs: per output token (logprob, [(token id, logprob)] of the top alternatives)
    out_lps: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    detok: DetokState = dataclasses.field(default_factory=DetokState)  # the streamed text so far
    slot: int | None = None
    verify_ct: int = 0
    hist: list[int] | None = None
    acc: np.ndarray | None = None  # [2, D] rounds that reached / accepted each depth (adaptive speculation)
    shape_rounds: dict[str, int] = dataclasses.field(default_factory=dict)  # rounds per adaptive candidate
    finished: bool = False
    cancelled: bool = False
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter)
    t_first: float | None = None
    decoding: bool = False  # prefilled: its slot takes part in dispatches
    known: int = 0  # tokens (prompt + output) whose results the host has processed
    inflight: int = 0  # dispatches enqueued for this request whose results are not processed yet
    # stop token ids (EOS, stop_token_ids, 1-token stop strings)
    _stops: list[int] = dataclasses.field(default_factory=list)
    _reuse: int = 0  # at admission: prompt positions whose KV its slot holds (or will, once copied)
    grammar: str | None = None  # constrained output: its validated llguidance grammar (jaxspec/grammar.py)
    handle: int = -1  # while decoding a grammar: its matcher's handle (SamplingTensors.grammar)

    @property
    def text(self) -> str:
        return self.detok.text

    def send(self, event: dict) -> None:
        """emit(event), never raising into the scheduler (a client's event loop may be gone)."""
        try:
            self.emit(event)
        except Exception:
            logger.warning("request %s: could not deliver a %s event", self.rid, event.get("type"), exc_info=True)


@dataclasses.dataclass(eq=False)
class PrefillGroup:
    """Requests admitted together, prefilled chunk by chunk (one compiled program per chunk)."""

    reqs: list[Request]
    chunk: int  # prompt tokens per chunk
    keys: list[tuple]  # the compiled program of each chunk (server/programs.py)
    prompt: np.ndarray  # [len(reqs), len(keys) * chunk] int32, zero-padded
    dprompt: np.ndarray  # the draft's prompt (shifted)
    start: int = 0  # the first chunk's position (positions before it are cached)
    next: int = 0  # the next chunk to run

    @property
    def n_chunks(self) -> int:
        return len(self.keys)


def cost_kind(key: tuple, sampled: bool) -> bool:
    """Whether dispatch program `key` runs its sampler for a call (`sampled`: some slot draws), the
    kind adaptive speculation keeps its costs under: a greedy call served by a sampling program
    skips the sampler on CPU (jaxspec/sampling.py SKIP_UNUSED) and costs what a greedy program does."""
    return key[3] and (sampled or not skips_unused())


@dataclasses.dataclass
class Pending:
    """A device call whose results the host has not fetched yet."""

    kind: str  # "admit" (first tokens) | "dispatch" (k rounds)
    reqs: list[Request]  # admit: the group's requests
    slots: dict[int, Request]  # dispatch: slot -> request
    out: Any  # device arrays
    seq: int = 0  # this call's place among the device calls (Scheduler._seq)
    t_enqueued: float = 0.0
    spec: Any = None  # dispatch: the tree shape it ran (None: plain steps or plain decoding)
    key: tuple = ()  # dispatch: its compiled program
    compiles: tuple[int, int] = (0, 0)  # dispatch: Programs.compile_mark() when it was enqueued

    @property
    def who(self) -> list[Request]:
        return self.reqs if self.kind == "admit" else list(self.slots.values())


@dataclasses.dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    failed: int = 0  # requests ended by an internal error (the server kept running)
    recoveries: int = 0  # times the device state was lost and re-created
    grammar_rejections: int = 0  # constrained requests failed because their matcher refused an emitted token
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled (not cached; padding not counted)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    generation_tokens: int = 0
    spec_tokens: int = 0  # tokens of finished speculative requests, less those of plain steps
    spec_verify_ct: int = 0  # their speculative rounds
    spec_plain_steps: int = 0  # their plain steps (adaptive speculation turned speculation off)
    # tree shape (speculative/adaptive.py shape_label) -> dispatches / rounds run with it
    shape_dispatches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    shape_rounds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # (time, new tokens)
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=4096))

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        n = sum(c for t, c in list(self.recent) if now - t <= window)
        return n / window


class Scheduler:
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
    ):
        self.eng = eng
        self.prefix_cache = prefix_cache
        # free slot -> the tokens whose KV (target and draft) it holds, and when it was last used
        self.cached: dict[int, np.ndarray] = {}
        self._used: dict[int, float] = {}
        # the shortest prefix worth a copy (or a wait for a prompt being prefilled): one small chunk
        self.min_reuse = min(64, eng.chunked_prefill_size)
        self.spec = eng.spec if eng.spec.enabled else None
        self.prop = eng.proposer if self.spec else None
        # adaptive speculation: per dispatch, the tree shape or plain steps (its own cost table:
        # a dispatch's rounds are not the offline engine's programs)
        self.adaptive = Adaptive(self.spec, margin=SERVER_MARGIN) if self.spec and self.spec.adaptive else None
        # label -> tree shape of each dispatch kind (server/programs.py): the configured one first
        cands = self.adaptive.candidates if self.adaptive else [self.spec]
        self.shapes: dict[str, SpecConfig | None] = {shape_label(c): c for c in cands}
        self.main_shape = shape_label(self.spec)
        gpu = jax.devices()[0].platform != "cpu"
        self.k = int(decode_steps or (8 if gpu else 2))
        # smallest KV span a program reads: long spans cost little on a GPU (fewer programs), but
        # attention over unused columns is a visible share of a CPU decode step (27 vs 32 tok/s)
        self.min_span = int(min_span or (512 if gpu else 64))
        if self.k < 1:
            raise JaxspecError("--num-continuous-decode-steps must be >= 1")
        steps = self.spec.num_steps if self.spec else 0
        self.window = self.k * (steps + 1)
        self.scratch = eng.spec.scratch_tokens  # KV columns a round writes past a request's last token
        self.context_length = eng.context_length
        self.max_len = -(-(self.context_length + self.scratch) // 64) * 64
        self.num_stop = 8
        # constrained decoding: slots carry grammar handles, and programs mask by them on demand
        # (host callbacks; not under tensor parallelism, where requests with a grammar are refused)
        self.grammar = eng.tp_size == 1
        self._slot_handle: dict[int, int] = {}  # slot -> the matcher handle of its latest request
        self.overlap = overlap
        self.max_queued = max_queued_requests
        self.slots = self._plan_memory(max_running_requests, mem_fraction_static, gpu)
        self.batch = self._new_batch(self.slots)
        self.release_kv()
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

    def release_kv(self) -> int:
        """Hands the KV caches' pages back to the kernel (server/memory.py release_pages): only
        while every slot is free and holds no cached prefix (their contents no longer matter), and
        no device call is in flight. Returns the bytes released."""
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
            self.spec.num_steps if self.spec else 0,
            eng.kv_sharding if sharded else None,
            top_logprobs=top_k_for(eng.cfg.vocab_size),
            grammar=self.grammar,
        )

    # ---- public API (any thread) -------------------------------------------------------------

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.eng.cfg.vocab_size
        check_prompt(
            ids, self.context_length, vocab, hint="; shorten the prompt or restart with a larger --context-length"
        )
        params.validate()
        check_stop_token_ids(params, vocab)

    def submit(self, req: Request) -> None:
        """Queues a request (raises JaxspecError for bad input, QueueFull when the queue is full)."""
        self.validate(req.ids, req.params)
        p = req.params
        req.max_new = min(p.max_new_tokens, self.context_length - len(req.ids))
        req.grammar = self.eng.grammar_of(p)
        if self.spec and (p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty):
            req.speculative = False  # penalties: this request decodes plainly (inside the round)
        eng = self.eng
        with self.tok_lock:  # stop strings are tokenized
            stops = stop_token_ids(eng.cfg, eng.tokenizer, p)
            if len(stops) > self.num_stop:
                eos = stop_token_ids(eng.cfg, eng.tokenizer, SamplingParams())
                raise JaxspecError(f"at most {self.num_stop - len(eos)} stop token ids per request")
        req._stops = stops
        with self.lock:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queued:
                self.stats.rejected += 1
                raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-queued-requests {self.max_queued})")
            self.stats.requests += 1
            self.stats.prompt_tokens += len(req.ids)
            if req.max_new <= 0:  # nothing to generate (max_tokens 0)
                self._finish(req, {"type": "length", "length": 0})
                return
            self.waiting.append(req)
            self.wake.notify()

    def cancel(self, req: Request) -> None:
        """The client went away: drops the request (waiting or running) and frees its slot."""
        with self.lock:
            if req.finished or req.cancelled:
                return
            req.cancelled = True
            self.stats.aborted += 1
            self._close_grammar(req)
            if req in self.waiting:
                self.waiting.remove(req)
            elif req.decoding and self.busy.get(req.slot) is req:
                del self.busy[req.slot]  # the next dispatch stops the slot (it is not decoding any more)
            # a request still being prefilled keeps its slot until its group's prefill ends
            logger.info("request %s cancelled", req.rid)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jaxspec-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still waiting or running get an "abort" finish."""
        with self.lock:
            self._stop = True
            self.wake.notify()
        self.programs.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        with self.lock:
            left = list(self.waiting) + list(self.busy.values())
            self.waiting.clear()
            self.busy.clear()
            for r in left:
                if not r.finished:
                    self.stats.aborted += 1
                    self._finish(r, {"type": "abort", "message": "server shutting down"})

    def idle_for(self, seconds: float) -> bool:
        """Whether no request has been waiting or running for the last `seconds`."""
        with self.lock:
            busy = bool(self.waiting or self.busy or self._pending or self._prefilling)
            if busy:
                self._last_busy = time.perf_counter()
        return not busy and time.perf_counter() - self._last_busy >= seconds

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.busy)

    # ---- the loop (scheduler thread) ---------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.lock:
                while (
                    not self._stop and not self.waiting and not self.busy and not self._pending and not self._prefilling
                ):
                    if self.programs.fresh:
                        break
                    self.wake.wait(0.5)
                if self._stop:
                    return
                idle = not self.waiting and not self.busy and not self._pending and not self._prefilling
                fresh = self.programs.fresh.popleft() if idle and self.programs.fresh else None
            if fresh is not None:  # a program the background compiled: run it once while nothing else runs
                self._guarded(f"running {fresh[0]} once", [], lambda: self.programs.exercise(*fresh))  # noqa: B023
                continue
            try:
                self.step()
            except Exception as e:
                logger.exception("scheduler iteration failed")
                try:
                    self._recover(f"{type(e).__name__}: {e}")
                except Exception as e2:
                    logger.exception("could not recover the device state")
                    self.error = f"{type(e2).__name__}: {e2}"
                    with self.lock:
                        self._stop = True
                        left = list(self.waiting)
                        self.waiting.clear()
                    for r in left:
                        self._fail(r, f"internal error: {self.error}")
                    return

    def step(self) -> None:
        """One scheduling iteration: admit, one prefill chunk, dispatch, process finished work.

        Each device call and each result is guarded: an exception fails the requests it was for
        (an "error" event, counted in Stats.failed), and if the device state was lost with it
        (a program failed after its input buffers were donated) the state is re-created."""
        self._admit()
        with self.lock:
            decoding = any(r.decoding for r in self.busy.values())
        self._prefill(interleave=decoding)
        with self.lock:
            busy = {s: r for s, r in self.busy.items() if r.decoding}
        if busy:
            self._guarded("decoding", list(busy.values()), lambda: self._dispatch(busy))
        keep = 1 if self.overlap and busy else 0  # leave the newest dispatch running while the host works
        while len(self._pending) > keep:
            item = self._pending.popleft()
            self._guarded("fetching results", item.who, lambda item=item: self._process(item))

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
            self.batch = None
            with self.lock:
                self.cached.clear()
            self.batch = self._new_batch(self.slots)
            self.release_kv()
            with self.lock:
                self.stats.recoveries += 1
            self.last_recovery = why
        finally:
            self.recovering = False

    def _fail(self, r: Request, message: str) -> None:
        """Ends one request with an "error" event and frees its slot."""
        with self.lock:
            if r.finished:
                return
            r.finished = True
            if r in self.waiting:
                self.waiting.remove(r)
            if r.slot is not None and self.busy.get(r.slot) is r:
                del self.busy[r.slot]
            if not r.cancelled:
                self.stats.failed += 1
            self._close_grammar(r)
        r.send({"type": "error", "message": message})

    def run_until_idle(self) -> None:
        """Drives the loop in the calling thread until every request finished (tests, offline use)."""
        while True:
            with self.lock:
                idle = not self.waiting and not self.busy and not self._pending and not self._prefilling
            if idle:
                return
            self.step()

    def _admit(self) -> None:
        """Waiting requests take free slots (`_pick_slot`), reusing cached prefixes (the module
        docstring), in power-of-two groups (each group size compiles once); their prompts are
        prefilled chunk by chunk by `_prefill`."""
        copies: list[tuple[Request | None, int, int, int]] = []  # (request or None: a move, src, dst, columns)
        with self.lock:
            free = [s for s in range(self.slots) if s not in self.busy]
            if not free or not self.waiting:
                return
            # prompts whose KV is being computed (a later request sharing their prefix waits for it)
            pending = [np.asarray(r.ids) for g in self._prefilling for r in g.reqs] if self.prefix_cache else []
            shift = self.prop.shift if self.prop is not None else 0
            reqs = []
            # the first few waiting requests only: the scan runs every iteration, and a long queue
            # would make it slow (those behind wait no longer than the prefills in progress)
            for r in list(itertools.islice(self.waiting, 4 * self.slots)):
                if not free:
                    break
                ids = np.asarray(r.ids)
                src, m = self._lookup(ids)
                if any(common_prefix(ids, p) >= m + self.min_reuse for p in pending):
                    continue
                self.waiting.remove(r)
                slot = self._pick_slot(free, src)
                free.remove(slot)
                r.slot = slot
                self.busy[slot] = r
                if src is not None:
                    self._used[src] = time.perf_counter()
                # the draft's entry p holds token p + shift: the last `shift` cached positions are recomputed
                r._reuse = max(m - shift, 0) if src == slot or m - shift >= self.min_reuse else 0
                old = self.cached.pop(slot, None)
                if old is not None and src != slot:  # (reused in place, its tail is superseded)
                    to = self._evict_for(old, self._used.get(slot, 0.0), free)  # keep it, in a less useful slot
                    if to is not None:
                        copies.append((None, slot, to, len(old)))
                if r._reuse and src != slot:
                    copies.append((r, src, slot, r._reuse))
                pending.append(ids)
                reqs.append(r)
        for r, src, dst, cols in copies:  # in order: a slot is read before it is overwritten
            who = [] if r is None else [r]
            if not self._guarded("copying a cached prefix", who, lambda a=(src, dst, cols): self._copy(*a)):
                if r is None:
                    self.forget([dst], 0)
                elif r in reqs:
                    reqs.remove(r)
        # groups of requests reusing a cached prefix prefill from there: they are not mixed with the others
        for part in ([r for r in reqs if not r._reuse], [r for r in reqs if r._reuse]):
            while part:
                n = 1 << (len(part).bit_length() - 1)
                if not self.programs.lazy:  # the largest group whose programs are compiled (n = 1 always is)
                    while n > 1 and not self._can_group(part[:n]):
                        n //= 2
                self._prefilling.append(self._new_group(part[:n]))
                part = part[n:]

    def _can_group(self, reqs: list[Request]) -> bool:
        progs = self.programs
        length, start = max(len(r.ids) for r in reqs), min(r._reuse for r in reqs)
        return len(reqs) in progs.finish_sizes() and progs.prefill_plan(len(reqs), length, start=start) is not None

    def _lookup(self, ids: np.ndarray) -> tuple[int | None, int]:
        """(lock held) The slot holding the longest prefix of the prompt `ids` [L] and its length
        (at most L - 1: the last prompt token is always prefilled, for its logits), or (None, 0).
        Free slots hold what `cached` says; decoding slots their prompt."""
        if not self.prefix_cache:
            return None, 0
        held = list(self.cached.items())
        held += [(s, np.asarray(r.ids)) for s, r in self.busy.items() if r.decoding and not r.cancelled]
        best, src = 0, None
        for s, toks in held:
            m = common_prefix(ids, toks)
            if m > best:
                best, src = m, s
        return src, min(best, len(ids) - 1)

    def _pick_slot(self, free: list[int], src: int | None) -> int:
        """(lock held) The free slot a new request takes: the one keeping dispatches smallest (they
        cover slots [0, n_act), n_act a power of two above the highest busy slot), then the slot
        holding its prefix (no copy), then one holding nothing, then the least recently used."""
        top = max(self.busy, default=-1)
        return min(
            free,
            key=lambda s: (bucket(max(top, s) + 1), s != src, s in self.cached, self._used.get(s, 0.0), s),
        )

    def _evict_for(self, toks: np.ndarray, used: float, free: list[int]) -> int | None:
        """(lock held) A free slot to move the cached prefix `toks` (last used at `used`) to, when
        its own slot is taken by a request that does not reuse it: one holding nothing,
        else the least recently used if it was used before `toks`; the highest first (the lowest
        are taken first). Marks it as holding `toks`. None: no such slot, or too short a prefix to
        be worth a copy (then it is evicted)."""
        if len(toks) < self.min_reuse or not free:
            return None
        to = min(free, key=lambda s: (s in self.cached, self._used.get(s, 0.0), -s))
        if to in self.cached and self._used.get(to, 0.0) >= used:
            return None
        self.cached[to], self._used[to] = toks, used
        return to

    def _copy(self, src: int, dst: int, columns: int) -> None:
        """The KV of the first `columns` positions of slot src into slot dst (copy_prefix)."""
        prog = self.programs.get(("copy",))
        self._seq += 1
        self._admit_seq = self._seq
        self.batch = prog(self.batch, jnp.int32(src), jnp.int32(dst), jnp.int32(columns))

    def forget(self, rows, col: int) -> None:
        """The slots `rows` are overwritten from column `col` on (a program run on free slots):
        their cached prefixes are cut before it (one more column: the draft's entries are shifted)."""
        with self.lock:
            for s in rows:
                if s in self.cached:
                    self.cached[s] = self.cached[s][: max(col - 1, 0)]
                    if not len(self.cached[s]):
                        del self.cached[s]

    def flush_cache(self) -> int:
        """Forgets every cached prefix (free slots; running requests keep theirs). Returns how many slots held one."""
        with self.lock:
            n = len(self.cached)
            self.cached.clear()
        return n

    def _new_group(self, reqs: list[Request]) -> PrefillGroup:
        length, start = max(len(r.ids) for r in reqs), min(r._reuse for r in reqs)
        plan = self.programs.prefill_plan(len(reqs), length, start=start)
        if plan is None:  # nothing compiled covers it: the ideal shapes, compiled at first use
            plan = self.programs.prefill_plan(len(reqs), length, exact=True, start=start)
        assert plan is not None
        chunk, first, keys = plan
        prompt = np.zeros((len(reqs), first + len(keys) * chunk), np.int32)
        for i, r in enumerate(reqs):
            prompt[i, : len(r.ids)] = r.ids
        dprompt = draft_prompt(prompt, self.prop.shift if self.prop is not None else 0)
        with self.lock:
            for r in reqs:
                r.cached_tokens = first
                self.stats.cached_tokens += first
                self.stats.prefill_tokens += len(r.ids) - first
        return PrefillGroup(reqs, chunk, list(keys), prompt[:, first:], dprompt[:, first:], start=first)

    def _prefill(self, interleave: bool) -> None:
        """Runs prefill chunks, group after group, until --chunked-prefill-size prompt tokens (padding
        included) have been prefilled in this iteration (SGLang's chunked prefill: a long prompt
        does not stall the others' streams, and a burst of short ones is admitted a budget at a
        time rather than one request per dispatch); at least one chunk, and when nothing is
        decoding (interleave False), at least until one group has its first token."""
        budget, used, started = self.eng.chunked_prefill_size, 0, False
        while self._prefilling and (used < budget or not (interleave or started)):
            g = self._prefilling[0]
            if all(r.cancelled for r in g.reqs):  # nobody is waiting for this group any more
                self._prefilling.popleft()
                self._release(g.reqs)
                continue
            if not self._guarded("prefilling", g.reqs, lambda g=g: self._prefill_chunk(g)):
                if self._prefilling and self._prefilling[0] is g:
                    self._prefilling.popleft()
                return
            used += g.chunk * len(g.reqs)
            if g.next == g.n_chunks:
                self._prefilling.popleft()
                started = True
                self._guarded("starting decoding", g.reqs, lambda g=g: self._finish_admission(g.reqs))

    def _prefill_chunk(self, g: PrefillGroup) -> None:
        eng, c, chunk = self.eng, g.next, g.chunk
        rows = jnp.asarray([r.slot for r in g.reqs], jnp.int32)
        sl = slice(c * chunk, (c + 1) * chunk)
        prog = self.programs.get(g.keys[c])
        self._seq += 1
        self._admit_seq = self._seq
        self.batch = prog(
            eng.params,
            eng.dparams,
            self.batch,
            rows,
            jnp.asarray(g.prompt[:, sl]),
            jnp.asarray(g.dprompt[:, sl]),
            jnp.int32(g.start + c * chunk),
            jnp.asarray([len(r.ids) for r in g.reqs], jnp.int32),
        )
        g.next += 1

    def _finish_admission(self, reqs: list[Request]) -> None:
        eng, n = self.eng, len(reqs)
        rows = jnp.asarray([r.slot for r in reqs], jnp.int32)
        params = [r.params for r in reqs]
        seeds = [p.seed if p.seed is not None else int(self._rng.integers(2**31)) for p in params]
        handles = None
        if self.grammar:
            for r in reqs:
                grammar.close_handle(self._slot_handle.pop(r.slot, -1))
                if r.grammar is not None:
                    r.handle = self._slot_handle[r.slot] = eng.open_grammar(r.grammar)
            handles = [r.handle for r in reqs]
        st = SamplingTensors.build(params, seeds, handles)
        stops = np.full((n, self.num_stop), -1, np.int32)
        seen = np.zeros((n, eng.cfg.vocab_size), bool)
        for i, r in enumerate(reqs):
            stops[i, : len(r._stops)] = r._stops
            seen[i, r.ids] = True
        prog = self.programs.get(("finish", n))
        self._seq += 1
        self._admit_seq = self._seq
        self.batch, first = prog(
            eng.params,
            eng.dparams,
            self.batch,
            rows,
            st,
            jnp.asarray([r.max_new for r in reqs], jnp.int32),
            jnp.asarray(stops),
            jnp.asarray([not r.speculative for r in reqs]),
            jnp.asarray(seen),
        )
        with self.lock:
            for r in reqs:
                r.known, r.inflight = len(r.ids) + 1, 0
                r.decoding = not r.cancelled
        self._release([r for r in reqs if r.cancelled])
        self._pending.append(Pending("admit", reqs, {}, first, self._seq))

    def _release(self, reqs: list[Request]) -> None:
        """Frees the slots of requests cancelled while they were being prefilled."""
        with self.lock:
            for r in reqs:
                if self.busy.get(r.slot) is r:
                    del self.busy[r.slot]

    def _span(self, need: int) -> int:
        """KV columns a program reads: the smallest compiled span >= need (server/programs.py spans)."""
        return self.programs.span_for(need)

    def _dispatch(self, busy: dict[int, Request]) -> None:
        n_act = min(bucket(max(busy) + 1), self.slots)
        if n_act > self.slots:
            n_act = self.slots
        for r in busy.values():
            r.inflight += 1
        # attention must see every column a slot can reach by the end of this dispatch
        need = max(r.known + r.inflight * self.window for r in busy.values()) + self.scratch
        # every slot not decoding a live request stops: finished, cancelled, prefilling or free
        kill = np.ones((self.slots,), bool)
        kill[list(busy)] = False
        eng = self.eng
        sampled = any_sampled(r.params for r in busy.values())
        span = self._span(need)
        lps = any(r.top_logprobs is not None for r in busy.values())
        gram = any(r.handle >= 0 for r in busy.values())
        spec = self._choose(busy, n_act, span, sampled, lps, gram)
        if not gram:
            # this call's own programs (where a larger one serves it), compiled at the next quiet
            # moment: the configured shape's and plain steps', sampling ones (they serve greedy
            # slots too): the memory-map budget holds only a few more programs
            for x in {self.main_shape, OFF} & self.shapes.keys():
                self.programs.want(("dispatch", n_act, span, True, x, lps, False))
        key = self.programs.dispatch_key(n_act, span, sampled, shape_label(spec), lps, gram)
        if key is None:  # another candidate chosen but not compiled yet: the configured shape serves as well
            spec, key = self.spec, self.programs.dispatch_key(n_act, span, sampled, logprobs=lps, grammar=gram)
        prog = self.programs.get(key)
        self._seq += 1
        t = time.perf_counter()
        self.batch, outs = prog(eng.params, eng.dparams, self.batch, jnp.asarray(kill))
        marks = self.programs.compile_mark()
        self._pending.append(Pending("dispatch", [], busy, outs, self._seq, t, spec, key, marks))

    def _choose(self, busy: dict[int, Request], n_act: int, span: int, sampled: bool, lps: bool, gram: bool = False):
        """The tree shape for the next dispatch, or None (plain steps): adaptive speculation's
        choice from the running requests' acceptance so far (self.spec when it is off), among the
        candidates that a compiled program covers for this call (a candidate without one would
        never be measured, and the choice would stay on it), each costed at the batch size and span
        of the program it would run with."""
        if self.adaptive is None:
            return self.spec
        keys = {x: self.programs.dispatch_key(n_act, span, sampled, x, lps, gram) for x in self.shapes}
        allowed = {x: (k[1], k[2], cost_kind(k, sampled)) for x, k in keys.items() if k is not None}
        spec_reqs = [r for r in busy.values() if r.speculative]
        none = self.adaptive.empty(1)[0]
        acc = np.array([none if r.acc is None else r.acc for r in spec_reqs]).reshape((-1,) + none.shape)
        greedy = np.array([not any_sampled([r.params]) for r in spec_reqs], bool)
        return self.adaptive.choose(n_act, acc, greedy, n_plain=len(busy) - len(spec_reqs), allowed=allowed)

    # ---- results -----------------------------------------------------------------------------

    def _process(self, item: Pending) -> None:
        want_lps = any(r.top_logprobs is not None for r in item.who)
        if item.kind == "admit":
            who = item.reqs
            first, lps = jax.device_get(item.out[:2] if want_lps else (item.out[0], None))
            now = t_got = time.perf_counter()
            for i, (r, t) in enumerate(zip(who, first)):
                r.t_first = now
                self._guarded(
                    "streaming",
                    [r],
                    functools.partial(
                        self._advance,
                        r,
                        [int(t)],
                        done_code=None,
                        verify_ct=0,
                        hist=None,
                        first=True,
                        lps=None if lps is None else logprob_rows(lps, i, 0, 1, lps.k),
                    ),
                )
            new = len(who)
        else:
            out, count, done, finish, vct, hist = jax.device_get(item.out[:6])
            lps = jax.device_get(item.out[6]) if want_lps else None
            t_got = time.perf_counter()
            if self.spec:
                self._observe(item, vct, hist, t_got)
            for s, r in item.slots.items():
                code = int(finish[s]) if done[s] else None
                toks = [int(t) for t in out[s, : count[s]]]
                r.inflight -= 1
                h = hist[s] if self.spec else None
                self._guarded(
                    "streaming",
                    [r],
                    functools.partial(
                        self._advance,
                        r,
                        toks,
                        done_code=code,
                        verify_ct=int(vct[s]),
                        hist=h,
                        lps=None if lps is None else logprob_rows(lps, s, 0, len(toks), lps.k),
                    ),
                )
            new = int(sum(count[s] for s in item.slots))
        self._last_fetched = (item.seq, t_got)
        with self.lock:
            self.stats.recent.append((time.perf_counter(), new))

    def _observe(self, item: Pending, vct, hist, t_got: float) -> None:
        """Bookkeeping of a speculative server's dispatch, before its requests advance: rounds per
        shape (per request and in Stats), and for adaptive speculation the dispatch's cost per
        round and the acceptance of its speculative requests. The device runs the calls in order,
        so a dispatch started when it was enqueued or when the call before it finished, whichever
        was later; it is timed only when that call's results were the last to arrive (a prefill
        chunk in between, whose end is not seen, would count as the dispatch's), no compile (a
        background one) ran meanwhile, which would make its shape look slow, and no prefill or
        admission was enqueued after it before its results were fetched. t_got: when its
        results arrived."""
        label = shape_label(item.spec)
        took = {s: int(vct[s]) - r.verify_ct for s, r in item.slots.items() if not (r.finished or r.cancelled)}
        rounds = max(took.values(), default=0)
        for s, r in item.slots.items():
            if s in took:
                r.shape_rounds[label] = r.shape_rounds.get(label, 0) + took[s]
        with self.lock:
            self.stats.shape_dispatches[label] += 1
            self.stats.shape_rounds[label] += rounds
        if self.adaptive is None:
            return
        seq, t_prev = self._last_fetched
        begun, ended = item.compiles
        quiet = begun == ended and self.programs.compile_mark() == item.compiles  # no compile shared the CPU
        # nor did the host enqueue admissions before it fetched these results (a burst of arrivals
        # delays the fetch: the first dispatch of a level once looked 10x as slow as it was)
        quiet &= self._admit_seq < item.seq
        if seq == item.seq - 1:
            dt = t_got - max(item.t_enqueued, t_prev)
            n, span = item.key[1:3]
            kind = cost_kind(item.key, any_sampled(r.params for r in item.slots.values()))
            self.adaptive.observe_cost(item.spec, n, dt, rounds if quiet else 0, (label, *item.key), span, kind)
            logger.debug(
                "dispatch %s: %d requests by a program of batch %d, span %d: %d rounds in %.1f ms%s",
                label,
                len(took),
                n,
                span,
                rounds,
                dt * 1e3,
                "" if quiet else " (beside a compile)",
            )
        if item.spec is None:
            return
        reqs = [(s, r) for s, r in item.slots.items() if r.speculative and s in took]
        if not reqs:
            return
        block = np.stack([hist[s][1:] - (np.asarray(r.hist) if r.hist is not None else 0) for s, r in reqs])
        greedy = np.array([not any_sampled([r.params]) for _, r in reqs], bool)
        acc = self.adaptive.observe_acceptance(block, greedy, item.spec.num_steps)
        for (_, r), x in zip(reqs, acc):
            r.acc = x if r.acc is None else r.acc + x

    def _advance(self, r: Request, toks, done_code, verify_ct, hist, first=False, lps=None) -> None:
        """r's next tokens from a device call (lps: their logprobs, when fetched)."""
        if r.finished or r.cancelled:
            return
        why = grammar.rejection(r.handle) if r.handle >= 0 else None
        if why is not None:  # never stream output that breaks its grammar: fail the request instead
            with self.lock:
                self.stats.grammar_rejections += 1
            logger.error("request %s failed: %s", r.rid, why)
            self._fail(r, f"internal error: {why}")
            return
        base = len(r.out_ids)
        r.out_ids += toks
        if r.top_logprobs is not None:
            assert lps is not None
            r.out_lps += [(lp, top[: r.top_logprobs]) for lp, top in lps]
        r.known = len(r.ids) + len(r.out_ids)
        if self.spec:
            r.verify_ct = verify_ct if not first else 0
            r.hist = None if hist is None else [int(x) for x in hist[1:]]
        else:
            r.verify_ct = len(r.out_ids)
        if first:  # admit_finish marks the slot done when its first token already ends it
            stops = set(r._stops)
            if toks[0] in stops:
                done_code = STOPPED
            elif r.max_new <= 1:
                done_code = LENGTH
        with self.lock:
            self.stats.generation_tokens += len(toks)
        reason = None if done_code is None else finish_reason(done_code, r.out_ids)
        delta, stop_hit = self._detok(r, final=reason is not None)
        if stop_hit is not None:
            reason = stop_hit
            toks = r.out_ids[base:]  # the stop string cut the output inside this dispatch's tokens
            del r.out_lps[len(r.out_ids) :]
        if delta or toks:
            event = {"type": "delta", "text": delta, "ids": toks}
            if r.top_logprobs is not None:
                event["logprobs"] = r.out_lps[base:]
            r.send(event)
        if reason is not None:
            with self.lock:
                if self.busy.get(r.slot) is r:
                    # a stop-string finish may still run on the device: the next dispatch stops it
                    del self.busy[r.slot]
                self._finish(r, reason)

    def _detok(self, r: Request, final: bool) -> tuple[str, dict | None]:
        """Extends r's text by its new tokens (server/detokenize.py); returns (text to stream,
        stop-string finish reason or None). A stop string cuts r.out_ids."""
        tok = self.eng.tokenizer
        if tok is None:
            return "", None
        delta, r.out_ids, hit = detokenize(
            tok, self.tok_lock, r.detok, r.out_ids, r.params.stop_strings, r.params.skip_special_tokens, final
        )
        return delta, hit

    def _finish(self, r: Request, reason: dict) -> None:
        """(lock held) Final event for a request."""
        r.finished = True
        self._close_grammar(r)
        st = self.stats
        if reason["type"] != "abort":
            st.finished += 1
            if self.spec and r.speculative and r.verify_ct:
                plain = r.shape_rounds.get(OFF, 0)
                st.spec_tokens += len(r.out_ids) - plain
                st.spec_verify_ct += r.verify_ct - plain
                st.spec_plain_steps += plain
        if self.prop is not None and self.spec.algorithm == "NGRAM" and reason["type"] != "abort":
            self._ngram_add(r)
        if self.prefix_cache and reason["type"] != "abort" and r.decoding and r.slot not in self.busy:
            # its slot keeps the KV of all but the last two tokens: the last one's was never written,
            # and the draft's entry for the one before may not have been either
            toks = np.asarray(list(r.ids) + list(r.out_ids), np.int32)[:-2]
            if len(toks):
                self.cached[r.slot] = toks
                self._used[r.slot] = time.perf_counter()
        r.send({"type": "done", "result": self.result(r, reason)})

    def _close_grammar(self, r: Request) -> None:
        """(lock held) Drops a finished request's matcher (its slot may still run a dispatch with
        the handle: an unknown handle masks nothing, and the slot is stopped)."""
        if r.handle >= 0:
            grammar.close_handle(r.handle)
            if self._slot_handle.get(r.slot) == r.handle:
                self._slot_handle.pop(r.slot, None)  # (cancel runs on another thread than admission)
            r.handle = -1

    def _ngram_add(self, r: Request) -> None:
        self.eng.feed_ngram_corpus([list(r.ids) + list(r.out_ids)])

    def result(self, r: Request, reason: dict) -> dict[str, Any]:
        spec = bool(self.spec and r.speculative)
        return make_result(
            r.rid,
            r.text,
            r.out_ids,
            len(r.ids),
            reason,
            time.perf_counter() - r.t_arrival,
            r.verify_ct if spec else len(r.out_ids),
            r.hist if spec else None,
            ttft=None if r.t_first is None else r.t_first - r.t_arrival,
            speculative=spec,
            cached_tokens=r.cached_tokens,
            **({"spec_shapes": self._shapes(r)} if spec and self.adaptive is not None else {}),
            **(output_logprobs(r.out_ids, r.out_lps) if r.top_logprobs is not None else {}),
        )

    def _shapes(self, r: Request) -> dict[str, int]:
        """Rounds r ran with each adaptive candidate (plain steps count one round each)."""
        assert self.adaptive is not None
        return {shape_label(c): r.shape_rounds.get(shape_label(c), 0) for c in self.adaptive.candidates}

    @property
    def plain_step_share(self) -> float:
        """The share of finished speculative requests' rounds that adaptive speculation ran as
        plain steps."""
        st = self.stats
        return st.spec_plain_steps / max(st.spec_plain_steps + st.spec_verify_ct, 1)

    @property
    def avg_spec_accept_length(self) -> float | None:
        st = self.stats
        return None if not st.spec_verify_ct else st.spec_tokens / st.spec_verify_ct


def warmup(sched: Scheduler, max_bs: int, progress: bool = True, background: bool = True) -> int:
    """Compiles the start-up cover set (server/programs.py) with a progress bar, then, if
    `background`, every other program shape in a background thread. Returns the number of
    start-up programs."""
    trim_heap()
    before = rss_bytes()
    n = sched.programs.compile_startup(max_bs, progress=progress)
    sched.programs.lazy = False
    # one short request through the whole path, so that the first client's does not set up the host side
    r = Request(
        ids=[1] * 4,
        params=SamplingParams(max_new_tokens=2 * sched.k + 2, temperature=0.0, ignore_eos=True),
        emit=lambda e: None,
    )
    sched.submit(r)
    sched.run_until_idle()
    with sched.lock:  # warm-up requests do not count
        sched.stats = Stats()
    sched.flush_cache()
    sched.release_kv()  # the programs' first runs wrote into free slots
    trim_heap()
    mem = sched.programs.memory
    mem.startup = n
    mem.per_program = max(rss_bytes() - before, 0) // max(n, 1) if before else 0
    r = sched.memory_report()
    gib = lambda x: f"{x / 2**30:.2f} GiB"
    logger.warning(
        "memory: weights %s; KV cache %s (%d slots x %d tokens; on a CPU its pages are taken as requests write "
        "them); %d compiled programs about %s (%.0f MiB each, budget %s); resident now %s",
        gib(r["weights_bytes"]),
        gib(r["kv_cache_bytes"]),
        r["slots"],
        r["context_length"],
        n,
        gib(mem.bytes),
        mem.per_program / 2**20,
        gib(mem.budget_bytes),
        gib(r["resident_bytes"]),
    )
    if background:
        sched.programs.start_background()
    return n

"""Continuous batching on the host: a bounded wait queue, slot allocation, streaming, cancellation.

One scheduler thread owns the device state (jaxspec/serving.py `SlotBatch`) and loops:
  admit     waiting requests take the lowest free slots, in power-of-two groups
  prefill   one prompt chunk per iteration while others decode (all chunks when nothing decodes),
            then the group's first tokens
  dispatch  k rounds for the decoding slots (one compiled program); every other slot is stopped
  process   fetch a dispatch's new tokens, detokenize, stream them, finish requests, free their slots
With overlap on (the default), dispatch i + 1 is enqueued before dispatch i's results are fetched,
so host work (detokenizing, streaming, admitting) runs while the device computes (JAX async
dispatch; SGLang's overlap scheduler). Requests talk to the thread through `Request.emit`, a
callback the HTTP layer points at its asyncio queue.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import LENGTH, STOPPED
from jaxspec.engine import Engine, bucket, tokens_through
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams, SamplingTensors
from jaxspec.serving import SlotBatch
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
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # filled by the scheduler
    max_new: int = 0
    out_ids: list = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already streamed
    prefix_off: int = 0  # incremental detokenizing: left context starts here (see Scheduler._detok)
    read_off: int = 0  # tokens already turned into r.text
    slot: int | None = None
    verify_ct: int = 0
    hist: list | None = None
    finished: bool = False
    cancelled: bool = False
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter)
    t_first: float | None = None
    decoding: bool = False  # prefilled: its slot takes part in dispatches
    known: int = 0  # tokens (prompt + output) whose results the host has processed
    inflight: int = 0  # dispatches enqueued for this request whose results are not processed yet
    _stops: list = dataclasses.field(default_factory=list)  # stop token ids (EOS, stop_token_ids, 1-token stop strings)

    def send(self, event: dict) -> None:
        """emit(event), never raising into the scheduler (a client's event loop may be gone)."""
        try:
            self.emit(event)
        except Exception:  # noqa: BLE001
            logger.warning("request %s: could not deliver a %s event", self.rid, event.get("type"), exc_info=True)


@dataclasses.dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    failed: int = 0  # requests ended by an internal error (the server kept running)
    recoveries: int = 0  # times the device state was lost and re-created
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_tokens: int = 0  # tokens of finished speculative requests
    spec_verify_ct: int = 0  # their rounds
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=4096))  # (time, new tokens)

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        n = sum(c for t, c in list(self.recent) if now - t <= window)
        return n / window


def memory_budget() -> tuple[int, str]:
    """(bytes the device can hold, where the figure comes from)."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{dev.platform} memory pool"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


def _nbytes(tree) -> int:
    """Bytes one device holds of the arrays (or shapes) in tree."""
    def size(x):
        s = getattr(x, "sharding", None)
        n = int(np.prod(x.shape if s is None else s.shard_shape(x.shape)))
        return n * (8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.dtype(x.dtype).itemsize)

    return sum(size(x) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))


class Scheduler:
    def __init__(self, eng: Engine, max_running_requests: int | None = None, mem_fraction_static: float = 0.8,
                 max_queued_requests: int = 256, decode_steps: int | None = None, overlap: bool = True, min_span: int | None = None):
        self.eng = eng
        self.spec = eng.spec if eng.spec.enabled else None
        self.prop = eng.proposer if self.spec else None
        gpu = jax.devices()[0].platform != "cpu"
        self.k = int(decode_steps or (8 if gpu else 2))
        # smallest KV span a program reads: long spans cost little on a GPU (fewer programs), but
        # attention over unused columns is a visible share of a CPU decode step (27 vs 32 tok/s)
        self.min_span = int(min_span or (512 if gpu else 64))
        if self.k < 1:
            raise JaxspecError("--num-continuous-decode-steps must be >= 1")
        steps = self.spec.num_steps if self.spec else 0
        self.window = self.k * (steps + 1)
        self.scratch = 0 if not self.spec else self.spec.num_draft_tokens + self.spec.num_steps * self.spec.eagle_topk + 2
        self.context_length = eng.context_length
        self.max_len = -(-(self.context_length + self.scratch) // 64) * 64
        self.num_stop = 8
        self.overlap = overlap
        self.max_queued = max_queued_requests
        self.slots = self._plan_memory(max_running_requests, mem_fraction_static, gpu)
        self.batch = SlotBatch.create(eng.cfg, self.prop, self.slots, self.max_len, self.window, self.num_stop, eng.dtype, steps,
                                      eng.kv_sharding)
        self.busy: dict[int, Request] = {}  # slot -> request (prefilling or decoding)
        self._prefilling: collections.deque = collections.deque()  # admission groups with prompt chunks left
        self.waiting: collections.deque[Request] = collections.deque()
        self.stats = Stats()
        self.lock = threading.Lock()  # waiting, busy, stats, cancellations
        self.wake = threading.Condition(self.lock)
        self.tok_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        self._pending: collections.deque = collections.deque()
        self._rng = np.random.default_rng(0)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.programs = Programs(self, lazy=True)  # server/launch.py compiles ahead and sets lazy=False
        self.error: str | None = None  # set when the scheduler could not recover: the server is down
        self.recovering = False  # True while the device state is being re-created
        self._last_busy = 0.0  # when idle_for last saw a request
        self.last_recovery: str | None = None  # why the device state was last re-created

    # ---- memory plan -------------------------------------------------------------------------

    def _plan_memory(self, requested, fraction, gpu) -> int:
        if not 0 < fraction <= 1:
            raise JaxspecError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
        steps = self.spec.num_steps if self.spec else 0
        one = jax.eval_shape(lambda: SlotBatch.create(self.eng.cfg, self.prop, 1, self.max_len, self.window, self.num_stop, self.eng.dtype, steps))
        kv = _nbytes((one.core.cache.k, one.core.cache.v))
        per_slot = _nbytes(one) - kv + kv // self.eng.tp_size  # eval_shape drops shardings; the target's KV is split tp ways
        weights = _nbytes(self.eng.params) + (_nbytes(self.eng.dparams) if self.spec else 0)
        total, where = memory_budget()
        budget = int(total * fraction) - weights
        fits = budget // per_slot if budget > 0 else 0
        gib = lambda x: f"{x / 2**30:.2f} GiB"  # noqa: E731
        plan = (f"per device: {where} {gib(total)} x mem_fraction_static {fraction} = {gib(total * fraction)}; weights (target + draft) "
                f"{gib(weights)}; one request slot (KV cache for context_length {self.context_length} + draft state) {gib(per_slot)}")
        if fits < 1:
            raise JaxspecError(
                f"out of memory: not even one request slot fits. {plan}. Try: a smaller --context-length, fewer "
                "--max-running-requests, a smaller speculative tree (--speculative-num-draft-tokens / --speculative-eagle-topk), "
                "--dtype bfloat16, or a higher --mem-fraction-static")
        cap = requested if requested is not None else (64 if gpu else 8)
        if cap < 1:
            raise JaxspecError("--max-running-requests must be >= 1")
        slots = int(min(cap, fits))
        if requested is not None and requested > fits:
            logger.warning("--max-running-requests %d does not fit; serving %d slots (%s)", requested, slots, plan)
        logger.info("memory plan: %s -> %d slots", plan, slots)
        self.memory_plan = dict(total_bytes=total, source=where, weights_bytes=weights, slot_bytes=per_slot, slots=slots)
        return slots

    # ---- public API (any thread) -------------------------------------------------------------

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) == 0:
            raise JaxspecError("the prompt is empty")
        if len(ids) >= self.context_length:
            raise JaxspecError(f"the prompt has {len(ids)} tokens; this server's context length is {self.context_length} "
                               "(prompt + output); shorten the prompt or restart with a larger --context-length")
        if min(ids) < 0 or max(ids) >= self.eng.cfg.vocab_size:
            raise JaxspecError(f"prompt token ids must be in [0, {self.eng.cfg.vocab_size})")
        params.validate()
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < self.eng.cfg.vocab_size]
        if bad:
            raise JaxspecError(f"stop_token_ids must be in [0, {self.eng.cfg.vocab_size}), got {bad[0]}")

    def submit(self, req: Request) -> None:
        """Queues a request (raises JaxspecError for bad input, QueueFull when the queue is full)."""
        self.validate(req.ids, req.params)
        p = req.params
        req.max_new = min(p.max_new_tokens, self.context_length - len(req.ids))
        if self.spec and (p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty):
            req.speculative = False  # penalties: this request decodes plainly (inside the round)
        with self.tok_lock:  # stop strings are tokenized
            stops = self.eng._stop_ids(p)
            if len(stops) > self.num_stop:
                raise JaxspecError(f"at most {self.num_stop - len(self.eng._stop_ids(SamplingParams()))} stop token ids per request")
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
                while not self._stop and not self.waiting and not self.busy and not self._pending and not self._prefilling:
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
            except Exception as e:  # noqa: BLE001 - a bug outside the guarded device calls: start over, keep serving
                logger.exception("scheduler iteration failed")
                try:
                    self._recover(f"{type(e).__name__}: {e}")
                except Exception as e2:  # noqa: BLE001 - cannot even rebuild the device state: the server is down
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
            who = item[1] if item[0] == "admit" else list(item[1].values())
            self._guarded("fetching results", who, lambda: self._process(item))

    def _guarded(self, what: str, reqs: list[Request], fn) -> bool:
        """fn(); on an exception fails `reqs` (and, if the device state is gone, every running request). True if fn succeeded."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001
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
        except Exception:  # noqa: BLE001
            return False

    def _recover(self, why: str) -> None:
        """Re-creates the slot state: every request holding a slot fails, waiting ones stay queued."""
        logger.error("device state lost (%s): failing the running requests and re-creating the request slots", why)
        self.recovering = True
        try:
            with self.lock:
                running = list(self.busy.values()) + [r for g in self._prefilling for r in g["reqs"]]
            for r in running:
                self._fail(r, f"internal error (the server recovered; retry the request): {why}")
            with self.lock:
                self.busy.clear()
                self._prefilling.clear()
                self._pending.clear()
            self.batch = None
            steps = self.spec.num_steps if self.spec else 0
            self.batch = SlotBatch.create(self.eng.cfg, self.prop, self.slots, self.max_len, self.window, self.num_stop,
                                          self.eng.dtype, steps, self.eng.kv_sharding)
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
        """Waiting requests take the lowest free slots, in power-of-two groups (each group size
        compiles once); their prompts are prefilled chunk by chunk by `_prefill`."""
        with self.lock:
            free = [s for s in range(self.slots) if s not in self.busy]
            take = min(len(free), len(self.waiting))
            if take == 0:
                return
            reqs = [self.waiting.popleft() for _ in range(take)]
            for s, r in zip(free, reqs):
                r.slot = s
                self.busy[s] = r
        progs = self.programs
        while reqs:
            n = 1 << (len(reqs).bit_length() - 1)
            if not progs.lazy:  # the largest group whose programs are compiled (n = 1 always is)
                sizes = progs.finish_sizes()
                while n > 1 and (n not in sizes or progs.prefill_plan(n, max(len(r.ids) for r in reqs[:n])) is None):
                    n //= 2
            self._prefilling.append(self._new_group(reqs[:n]))
            reqs = reqs[n:]

    def _new_group(self, reqs: list[Request]) -> dict:
        length = max(len(r.ids) for r in reqs)
        plan = self.programs.prefill_plan(len(reqs), length)
        if plan is None:  # nothing compiled covers it: the ideal shapes, compiled at first use
            plan = self.programs.prefill_plan(len(reqs), length, exact=True)
        chunk, keys = plan
        n_chunks = len(keys)
        prompt = np.zeros((len(reqs), n_chunks * chunk), np.int32)
        for i, r in enumerate(reqs):
            prompt[i, : len(r.ids)] = r.ids
        shift = self.prop.shift if self.prop is not None else 0
        dprompt = np.zeros_like(prompt)
        dprompt[:, : prompt.shape[1] - shift] = prompt[:, shift:]
        return dict(reqs=reqs, chunk=chunk, n_chunks=n_chunks, keys=keys, next=0, prompt=prompt, dprompt=dprompt)

    def _prefill(self, interleave: bool) -> None:
        """Runs prefill chunks: one chunk when requests are decoding (SGLang's chunked prefill: a
        long prompt does not stall the others' streams), else until a group has its first token."""
        while self._prefilling:
            g = self._prefilling[0]
            if all(r.cancelled for r in g["reqs"]):  # nobody is waiting for this group any more
                self._prefilling.popleft()
                self._release(g["reqs"])
                continue
            if not self._guarded("prefilling", g["reqs"], lambda: self._prefill_chunk(g)):
                if self._prefilling and self._prefilling[0] is g:
                    self._prefilling.popleft()
                return
            if g["next"] == g["n_chunks"]:
                self._prefilling.popleft()
                self._guarded("starting decoding", g["reqs"], lambda: self._finish_admission(g["reqs"]))
                return
            if interleave:
                return

    def _prefill_chunk(self, g: dict) -> None:
        eng, c, chunk = self.eng, g["next"], g["chunk"]
        rows = jnp.asarray([r.slot for r in g["reqs"]], jnp.int32)
        sl = slice(c * chunk, (c + 1) * chunk)
        prog = self.programs.get(g["keys"][c])
        self.batch = prog(eng.params, eng.dparams, self.batch, rows, jnp.asarray(g["prompt"][:, sl]), jnp.asarray(g["dprompt"][:, sl]),
                          jnp.int32(c * chunk), jnp.asarray([len(r.ids) for r in g["reqs"]], jnp.int32))
        g["next"] += 1

    def _finish_admission(self, reqs: list[Request]) -> None:
        eng, n = self.eng, len(reqs)
        rows = jnp.asarray([r.slot for r in reqs], jnp.int32)
        params = [r.params for r in reqs]
        seeds = [p.seed if p.seed is not None else int(self._rng.integers(2**31)) for p in params]
        st = SamplingTensors.build(params, seeds)
        stops = np.full((n, self.num_stop), -1, np.int32)
        seen = np.zeros((n, eng.cfg.vocab_size), bool)
        for i, r in enumerate(reqs):
            stops[i, : len(r._stops)] = r._stops
            seen[i, r.ids] = True
        prog = self.programs.get(("finish", n))
        self.batch, first = prog(eng.params, eng.dparams, self.batch, rows, st, jnp.asarray([r.max_new for r in reqs], jnp.int32),
                                 jnp.asarray(stops), jnp.asarray([not r.speculative for r in reqs]), jnp.asarray(seen))
        with self.lock:
            for r in reqs:
                r.known, r.inflight = len(r.ids) + 1, 0
                r.decoding = not r.cancelled
        self._release([r for r in reqs if r.cancelled])
        self._pending.append(("admit", reqs, first))

    def _release(self, reqs: list[Request]) -> None:
        """Frees the slots of requests cancelled while they were being prefilled."""
        with self.lock:
            for r in reqs:
                if self.busy.get(r.slot) is r:
                    del self.busy[r.slot]

    def _span(self, need: int) -> int:
        """KV columns a program reads: a power of two >= need and >= min_span."""
        return min(bucket(need, self.min_span), self.max_len)

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
        prog = self.programs.get(self.programs.dispatch_key(n_act, self._span(need)))
        self.batch, outs = prog(eng.params, eng.dparams, self.batch, jnp.asarray(kill))
        self._pending.append(("dispatch", busy, outs))

    # ---- results -----------------------------------------------------------------------------

    def _process(self, item) -> None:
        kind, who, arr = item
        if kind == "admit":
            first = np.asarray(jax.device_get(arr))
            now = time.perf_counter()
            for r, t in zip(who, first):
                r.t_first = now
                self._guarded("streaming", [r], lambda: self._advance(r, [int(t)], done_code=None, verify_ct=0, hist=None, first=True))  # noqa: B023
            new = len(who)
        else:
            out, count, done, finish, vct, hist = jax.device_get(arr)
            for s, r in who.items():
                code = int(finish[s]) if done[s] else None
                toks = [int(t) for t in out[s, : count[s]]]
                r.inflight -= 1
                h = hist[s] if self.spec else None
                self._guarded("streaming", [r], lambda: self._advance(r, toks, done_code=code, verify_ct=int(vct[s]), hist=h))  # noqa: B023
            new = int(sum(count[s] for s in who))
        with self.lock:
            self.stats.recent.append((time.perf_counter(), new))

    def _advance(self, r: Request, toks, done_code, verify_ct, hist, first=False) -> None:
        if r.finished or r.cancelled:
            return
        base = len(r.out_ids)
        r.out_ids += toks
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
        reason = None
        if done_code == STOPPED:
            reason = {"type": "stop", "matched": r.out_ids[-1]}
        elif done_code == LENGTH:
            reason = {"type": "length", "length": len(r.out_ids)}
        delta, stop_hit = self._detok(r, final=reason is not None)
        if stop_hit is not None:
            reason = stop_hit
            toks = r.out_ids[base:]  # the stop string cut the output inside this dispatch's tokens
        if delta or toks:
            r.send({"type": "delta", "text": delta, "ids": toks})
        if reason is not None:
            with self.lock:
                if self.busy.get(r.slot) is r:
                    del self.busy[r.slot]  # a stop-string finish may still run on the device: the next dispatch stops it
                self._finish(r, reason)

    def _detok(self, r: Request, final: bool):
        """Extends r.text by the new tokens; returns (text to stream, stop-string finish reason or None).

        Incremental: only the tokens after `r.prefix_off` are decoded (a few tokens of left context
        keep word-initial spaces and multi-byte characters right), so a long output costs O(n), not
        O(n^2). The final text is one full decode, as the offline engine's."""
        tok = self.eng.tokenizer
        if tok is None:
            return "", None
        skip = r.params.skip_special_tokens
        with self.tok_lock:
            if final:
                text = tok.decode(r.out_ids, skip_special_tokens=skip)
            else:
                before = tok.decode(r.out_ids[r.prefix_off : r.read_off], skip_special_tokens=skip)
                after = tok.decode(r.out_ids[r.prefix_off :], skip_special_tokens=skip)
                text = r.text
                if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
                    text = r.text + after[len(before) :]
                    r.prefix_off, r.read_off = max(r.read_off - 4, 0), len(r.out_ids)
        stops = [s for s in r.params.stop_strings if s]
        hit = None
        lo_search = max(0, min(r.sent, len(text)) - max((len(s) for s in stops), default=0))
        found = [(text.find(s, lo_search), s) for s in stops if s in text[lo_search:]]
        if found:
            pos, s = min(found)
            with self.tok_lock:
                r.out_ids = r.out_ids[: tokens_through(lambda x: tok.decode(x, skip_special_tokens=skip), r.out_ids, s)]
            text, hit, final = text[:pos], {"type": "stop", "matched": s}, True
        safe = len(text)
        if not final and stops:  # hold back what could be the start of a stop string
            safe -= max(len(s) for s in stops) - 1
        safe = max(safe, r.sent)
        delta = text[r.sent : safe]
        r.sent = safe
        r.text = text
        return delta, hit

    def _finish(self, r: Request, reason: dict) -> None:
        """(lock held) Final event for a request."""
        r.finished = True
        st = self.stats
        if reason["type"] != "abort":
            st.finished += 1
            if self.spec and r.speculative and r.verify_ct:
                st.spec_tokens += len(r.out_ids)
                st.spec_verify_ct += r.verify_ct
        if self.prop is not None and self.spec.algorithm == "NGRAM" and reason["type"] != "abort":
            self._ngram_add(r)
        r.send({"type": "done", "result": self.result(r, reason)})

    def _ngram_add(self, r: Request) -> None:
        corpus = self.eng._corpus
        corpus.add([list(r.ids) + list(r.out_ids)])
        self.eng.dparams = {**self.eng.dparams, "corpus": corpus.device()}

    def result(self, r: Request, reason: dict) -> dict[str, Any]:
        vct = r.verify_ct if (self.spec and r.speculative) else len(r.out_ids)
        meta = {
            "id": r.rid,
            "prompt_tokens": len(r.ids),
            "completion_tokens": len(r.out_ids),
            "finish_reason": reason,
            "e2e_latency": time.perf_counter() - r.t_arrival,
            "ttft": None if r.t_first is None else r.t_first - r.t_arrival,
            "speculative": bool(self.spec and r.speculative),
            "spec_verify_ct": vct,
            "spec_accept_length": len(r.out_ids) / max(vct, 1),
        }
        if self.spec and r.speculative and r.hist is not None:
            meta["spec_accept_histogram"] = r.hist
        return {"text": r.text, "output_ids": list(r.out_ids), "meta_info": meta}

    @property
    def avg_spec_accept_length(self) -> float | None:
        st = self.stats
        return None if not st.spec_verify_ct else st.spec_tokens / st.spec_verify_ct


def warmup(sched: Scheduler, max_bs: int, progress: bool = True, background: bool = True) -> int:
    """Compiles the start-up cover set (server/programs.py) with a progress bar, then, if
    `background`, every other program shape in a background thread. Returns the number of
    start-up programs."""
    n = sched.programs.compile_startup(max_bs, progress=progress)
    sched.programs.lazy = False
    # one short request through the whole path, so that the first client's does not set up the host side
    r = Request(ids=[1] * 4, params=SamplingParams(max_new_tokens=2 * sched.k + 2, temperature=0.0, ignore_eos=True), emit=lambda e: None)
    sched.submit(r)
    sched.run_until_idle()
    with sched.lock:  # warm-up requests do not count
        sched.stats = Stats()
    if background:
        sched.programs.start_background()
    return n

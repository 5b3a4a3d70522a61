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
import math
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
from jaxspec.serving import SlotBatch, admit_chunk, admit_finish, dispatch

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


@dataclasses.dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
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
        self.error: str | None = None

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

    def submit(self, req: Request) -> None:
        """Queues a request (raises JaxspecError for bad input, QueueFull when the queue is full)."""
        self.validate(req.ids, req.params)
        p = req.params
        req.max_new = min(p.max_new_tokens, self.context_length - len(req.ids))
        if self.spec and (p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty):
            req.speculative = False  # penalties: this request decodes plainly (inside the round)
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
        if self._thread is not None:
            self._thread.join(timeout)
        with self.lock:
            left = list(self.waiting) + list(self.busy.values())
            self.waiting.clear()
            self.busy.clear()
            for r in left:
                if not r.finished:
                    self._finish(r, {"type": "abort", "message": "server shutting down"})

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.busy)

    # ---- the loop (scheduler thread) ---------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self.lock:
                    while not self._stop and not self.waiting and not self.busy and not self._pending and not self._prefilling:
                        self.wake.wait(0.5)
                    if self._stop:
                        return
                self.step()
        except Exception as e:  # noqa: BLE001 - a bug: fail every request loudly, keep the HTTP side up
            logger.exception("scheduler crashed")
            self.error = f"{type(e).__name__}: {e}"
            with self.lock:
                self._stop = True
                for r in list(self.waiting) + list(self.busy.values()):
                    r.finished = True
                    r.emit({"type": "error", "message": f"internal error: {self.error}"})
                self.waiting.clear()
                self.busy.clear()

    def step(self) -> None:
        """One scheduling iteration: admit, one prefill chunk, dispatch, process finished work."""
        self._admit()
        with self.lock:
            decoding = any(r.decoding for r in self.busy.values())
        self._prefill(interleave=decoding)
        with self.lock:
            busy = {s: r for s, r in self.busy.items() if r.decoding}
        if busy:
            self._dispatch(busy)
        keep = 1 if self.overlap and busy else 0  # leave the newest dispatch running while the host works
        while len(self._pending) > keep:
            self._process(self._pending.popleft())

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
        while reqs:
            n = 1 << (len(reqs).bit_length() - 1)
            self._prefilling.append(self._new_group(reqs[:n]))
            reqs = reqs[n:]

    def _new_group(self, reqs: list[Request]) -> dict:
        chunk = min(bucket(self.eng.chunked_prefill_size), bucket(max(len(r.ids) for r in reqs), 64))
        n_chunks = -(-max(len(r.ids) for r in reqs) // chunk)
        prompt = np.zeros((len(reqs), n_chunks * chunk), np.int32)
        for i, r in enumerate(reqs):
            prompt[i, : len(r.ids)] = r.ids
        shift = self.prop.shift if self.prop is not None else 0
        dprompt = np.zeros_like(prompt)
        dprompt[:, : prompt.shape[1] - shift] = prompt[:, shift:]
        return dict(reqs=reqs, chunk=chunk, n_chunks=n_chunks, next=0, prompt=prompt, dprompt=dprompt)

    def _prefill(self, interleave: bool) -> None:
        """Runs prefill chunks: one chunk when requests are decoding (SGLang's chunked prefill: a
        long prompt does not stall the others' streams), else until a group has its first token."""
        while self._prefilling:
            g = self._prefilling[0]
            if all(r.cancelled for r in g["reqs"]):  # nobody is waiting for this group any more
                self._prefilling.popleft()
                self._release(g["reqs"])
                continue
            eng, c, chunk = self.eng, g["next"], g["chunk"]
            rows = jnp.asarray([r.slot for r in g["reqs"]], jnp.int32)
            sl = slice(c * chunk, (c + 1) * chunk)
            self.batch = admit_chunk(eng.graphdef, eng.params, self.prop, eng.dparams, self.batch, rows, jnp.asarray(g["prompt"][:, sl]),
                                     jnp.asarray(g["dprompt"][:, sl]), jnp.int32(c * chunk), jnp.asarray([len(r.ids) for r in g["reqs"]], jnp.int32),
                                     span=self._span(c * chunk + chunk), backend=eng.backend)
            g["next"] += 1
            if g["next"] == g["n_chunks"]:
                self._prefilling.popleft()
                self._finish_admission(g["reqs"])
                return
            if interleave:
                return

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
        self.batch, first = admit_finish(
            eng.graphdef, eng.params, self.prop, eng.dparams, self.batch, rows, st, jnp.asarray([r.max_new for r in reqs], jnp.int32),
            jnp.asarray(stops), jnp.asarray([not r.speculative for r in reqs]), jnp.asarray(seen),
            span=self._span(max(len(r.ids) for r in reqs) + 1), backend=eng.backend,
        )
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
        self.batch, outs = dispatch(eng.graphdef, eng.params, self.prop, eng.dparams, self.spec, self.batch, jnp.asarray(kill),
                                    k=self.k, n_act=n_act, span=self._span(need), backend=eng.backend)
        self._pending.append(("dispatch", busy, outs))

    # ---- results -----------------------------------------------------------------------------

    def _process(self, item) -> None:
        kind, who, arr = item
        if kind == "admit":
            first = np.asarray(jax.device_get(arr))
            now = time.perf_counter()
            for r, t in zip(who, first):
                r.t_first = now
                self._advance(r, [int(t)], done_code=None, verify_ct=0, hist=None, first=True)
            new = len(who)
        else:
            out, count, done, finish, vct, hist = jax.device_get(arr)
            for s, r in who.items():
                code = int(finish[s]) if done[s] else None
                toks = [int(t) for t in out[s, : count[s]]]
                r.inflight -= 1
                self._advance(r, toks, done_code=code, verify_ct=int(vct[s]), hist=hist[s] if self.spec else None)
            new = int(sum(count[s] for s in who))
        with self.lock:
            self.stats.recent.append((time.perf_counter(), new))

    def _advance(self, r: Request, toks, done_code, verify_ct, hist, first=False) -> None:
        if r.finished or r.cancelled:
            return
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
        if delta or toks:
            r.emit({"type": "delta", "text": delta, "ids": toks})
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
        r.emit({"type": "done", "result": self.result(r, reason)})

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


def warmup(sched: Scheduler, max_bs: int, progress: bool = True) -> int:
    """Compiles, for busy-slot counts n = 1, 2, 4, .. <= max_bs, the admission of n short prompts
    and the dispatch at every KV span from min_span up to 512, so that short requests do not wait
    for XLA. Returns the number of programs compiled."""
    from tqdm.auto import tqdm

    sizes = [1 << i for i in range(int(math.log2(max(1, min(max_bs, sched.slots)))) + 1)]
    spans = sorted({sched._span(x) for x in (sched.min_span, 128, 256, 512)})
    bar = tqdm(total=len(sizes) * (2 + len(spans)), unit="program", disable=not progress,
               desc=f"compiling (batch sizes {','.join(map(str, sizes))}; KV spans {','.join(map(str, spans))})")
    eng = sched.eng
    compiled = 0
    for n in sizes:
        reqs = [Request(ids=[1] * 8, params=SamplingParams(max_new_tokens=2, temperature=0.0), emit=lambda e: None) for _ in range(n)]
        for r in reqs:
            sched.submit(r)
        sched._admit()
        sched._prefill(interleave=False)  # admit_chunk + admit_finish
        bar.update(2)
        compiled += 2
        for span in spans:  # every slot killed: the loop exits at once, but the program compiles
            sched.batch, outs = dispatch(eng.graphdef, eng.params, sched.prop, eng.dparams, sched.spec, sched.batch,
                                         jnp.ones((sched.slots,), bool), k=sched.k, n_act=n, span=span, backend=eng.backend)
            jax.block_until_ready(outs)
            bar.update(1)
            compiled += 1
        for r in reqs:
            sched.cancel(r)
        sched.run_until_idle()
    bar.close()
    with sched.lock:  # warm-up requests do not count
        sched.stats = Stats()
    return compiled

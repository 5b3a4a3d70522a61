"""Continuous batching on the host: a bounded wait queue, slot allocation, streaming, cancellation.

One scheduler thread owns the device state (jaxspec/serving.py `SlotBatch`) and loops:
  admit     waiting requests take free slots (the lowest, or one holding their prompt's prefix),
            in power-of-two groups; a cached prefix is reused (server/prefix_cache.py)
  prefill   prompt chunks up to --chunked-prefill-size tokens per iteration while others decode
            (all of a group's chunks when nothing decodes), then each group's first tokens
  dispatch  k rounds for the decoding slots (one compiled program); every other slot is stopped.
            With adaptive speculation, plain steps instead when they are expected to be faster
  process   fetch a dispatch's new tokens, detokenize, stream them, finish requests, free their slots
With overlap on (the default), dispatch i + 1 is enqueued before dispatch i's results are fetched,
so host work (detokenizing, streaming, admitting) runs while the device computes (JAX async
dispatch; SGLang's overlap scheduler). Requests talk to the thread through `Request.emit`, a
callback the HTTP layer points at its asyncio queue.

The steps live in modules of their own: admission and prefill in server/admission.py (with the
prefix cache, server/prefix_cache.py, on unless --disable-radix-cache), dispatch and emission in
server/dispatch.py, the state and its recovery in server/scheduler_state.py; this module holds the
queue, the loop and the public API.
"""

from __future__ import annotations

import logging
import threading
import time

from jaxspec.errors import JaxspecError
from jaxspec.requests import check_prompt, check_stop_token_ids, stop_token_ids
from jaxspec.sampling import SamplingParams
from jaxspec.server.admission import Admission
from jaxspec.server.dispatch import Dispatch
from jaxspec.server.memory import rss_bytes, trim_heap
from jaxspec.server.records import QueueFull, Request, Stats

__all__ = ["QueueFull", "Request", "Scheduler", "warmup"]

logger = logging.getLogger("jaxspec.server")

FRESH_AFTER_IDLE = 0.5  # seconds without a scheduling step before a fresh program is run once


class Scheduler(Admission, Dispatch):
    """Continuous batching over the request slots (the module docstring); the constructor's
    arguments are server/scheduler_state.py SchedulerState's."""

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
        if self.eng.online is not None:
            self.eng.online.close()
        if self.nodes is not None:
            self.nodes.stop()
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

    def flush_cache(self) -> int:
        """Forgets every cached prefix (free slots; running requests keep theirs) and the text that
        finished requests left for text matching (NGRAM, --speculative-suffix-draft-tokens).
        Returns how many slots held a prefix."""
        with self.lock:
            if self.eng.spec.text_match is not None:
                self.eng.reset_ngram_corpus()
            return self.cache.flush()

    # ---- the loop (scheduler thread) ---------------------------------------------------------

    def _exercise(self, key: tuple, prog) -> None:
        if self.nodes is not None:
            self.nodes.tell_exercise(key)
        self.programs.exercise(key, prog)

    def _loop(self) -> None:
        while True:
            with self.lock:
                while (
                    not self._stop and not self.waiting and not self.busy and not self._pending and not self._prefilling
                ):
                    # a program not run yet, once nothing has run for a while (a client sending
                    # requests one after another would otherwise find one running at each request)
                    if self.programs.fresh and time.perf_counter() - self._last_step >= FRESH_AFTER_IDLE:
                        break
                    self.wake.wait(0.1 if self.programs.fresh else 0.5)
                if self._stop:
                    return
                idle = not self.waiting and not self.busy and not self._pending and not self._prefilling
                fresh = self.programs.fresh.popleft() if idle and self.programs.fresh else None
            if fresh is not None:  # a program the background compiled: run it once while nothing else runs
                self._guarded(f"running {fresh[0]} once", [], lambda: self._exercise(*fresh))  # noqa: B023
                continue
            try:
                self.step()
                self._last_step = time.perf_counter()
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
        if self.finished_slots:
            self.release_tails()

    def run_until_idle(self) -> None:
        """Drives the loop in the calling thread until every request finished (tests, offline use)."""
        while True:
            with self.lock:
                idle = not self.waiting and not self.busy and not self._pending and not self._prefilling
            if idle:
                return
            self.step()


def warmup(sched: Scheduler, max_bs: int, progress: bool = True, background: bool = True) -> int:
    """Compiles the start-up cover set (server/programs.py) with a progress bar, then, if
    `background`, every other program shape in a background thread. Returns the number of
    start-up programs."""
    trim_heap()
    before = rss_bytes()
    n = sched.programs.compile_startup(max_bs, progress=progress)
    if sched.nodes is not None and not sched.nodes.leader:  # the rest is node 0's, repeated here by follow()
        if background:
            sched.programs.start_background()
        return n
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
    rep = sched.memory_report()
    gib = lambda x: f"{x / 2**30:.2f} GiB"
    logger.warning(
        "memory: weights %s; KV cache %s (%d slots x %d tokens; on a CPU its pages are taken as requests write "
        "them); %d compiled programs about %s (%.0f MiB each, budget %s); resident now %s",
        gib(rep["weights_bytes"]),
        gib(rep["kv_cache_bytes"]),
        rep["slots"],
        rep["context_length"],
        n,
        gib(mem.bytes),
        mem.per_program / 2**20,
        gib(mem.budget_bytes),
        gib(rep["resident_bytes"]),
    )
    if background:
        sched.programs.start_background()
    return n

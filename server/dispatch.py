"""Dispatch and emission: k rounds for the decoding slots in one compiled program (the tree shape,
or plain steps, chosen per dispatch by adaptive speculation), then their results: new tokens
detokenized and streamed, finished requests closed, and the acceptance and cost of each dispatch
observed for adaptive speculation."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import grammar
from jaxspec.decode import LENGTH, STOPPED
from jaxspec.requests import bucket, finish_reason, logprob_rows, make_result, output_logprobs
from jaxspec.sampling import any_sampled, skips_unused
from jaxspec.server.detokenize import detokenize
from jaxspec.server.records import Pending, Request
from jaxspec.server.scheduler_state import SchedulerState
from jaxspec.speculative.adaptive import OFF, shape_label
from jaxspec.speculative.online import feature_window, read_features

logger = logging.getLogger("jaxspec.server")


def cost_kind(key: tuple, sampled: bool) -> bool:
    """Whether dispatch program `key` runs its sampler for a call (`sampled`: some slot draws), the
    kind adaptive speculation keeps its costs under: a greedy call served by a sampling program
    skips the sampler on CPU (jaxspec/sampling.py SKIP_UNUSED) and costs what a greedy program does."""
    return key[3] and (sampled or not skips_unused())


class Dispatch(SchedulerState):
    def _span(self, need: int) -> int:
        """KV columns a program reads: the smallest compiled span >= need (server/program_shapes.py spans)."""
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
        assert key is not None  # the configured shape's programs cover every call
        prog = self.programs.get(key)
        self._seq += 1
        t = time.perf_counter()
        self.batch, outs = prog(eng.models, self.batch, jnp.asarray(kill))
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
        acc = self.adaptive.observe_acceptance(block, greedy, item.spec.depth, item.spec)
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
        if self.spec is not None and self.spec.text_match is not None and reason["type"] != "abort":
            self._ngram_add(r)
        if self.eng.online is not None and reason["type"] != "abort":
            self._learn(r)
        if reason["type"] != "abort" and r.decoding and r.slot not in self.busy:
            # its slot keeps the KV of all but the last two tokens: the last one's was never written,
            # and the draft's entry for the one before may not have been either
            self.cache.keep(r.slot, np.asarray(list(r.ids) + list(r.out_ids), np.int32)[:-2])
            self.finished_slots.append(r.slot)  # its columns past the kept prefix go back (release_tails)
        r.send({"type": "done", "result": self.result(r, reason)})

    def _learn(self, r: Request) -> None:
        """(lock held) Hands a finished request to online draft training with the target features its
        slot's draft cache kept, read by a program enqueued now (before any later call can take
        the slot); handing back its slot's pages waits for that read where they hold columns it
        uses (release_tails)."""
        online = self.eng.online
        total = len(r.ids) + len(r.out_ids)
        if online is None or self.batch is None or r.slot < 0 or not r.out_ids or total < 3:
            return
        layer = self.feature_layer()
        first, size = feature_window(total, layer.shape[1])
        feats = read_features(layer, jnp.int32(r.slot), jnp.int32(first), size=size)
        self.feature_reads[r.slot] = (feats, total - 2)  # (the columns it reads past that are not used)
        online.observe(r.ids, r.out_ids, feats, first)

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

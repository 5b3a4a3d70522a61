"""Admission: waiting requests take free request slots, reuse cached prefixes
(server/prefix_cache.py), and are prefilled chunk by chunk until their first tokens.

A request whose prompt shares a longer prefix with one still being prefilled waits for it, so
that concurrent requests with a common system prompt compute it once. Requests are admitted in
power-of-two groups (each group size compiles once); a group's prompt is prefilled in chunks of
up to --chunked-prefill-size tokens per scheduler iteration (SGLang's chunked prefill), so a long
prompt does not stall the others' streams.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

from jaxspec import grammar
from jaxspec.requests import common_prefix, draft_prompt
from jaxspec.sampling import SamplingTensors
from jaxspec.server.records import Pending, PrefillGroup, Request
from jaxspec.server.scheduler_state import SchedulerState


class Admission(SchedulerState):
    def _admit(self) -> None:
        """Waiting requests take free slots (`PrefixCache.pick_slot`), reusing cached prefixes (the module
        docstring), in power-of-two groups (each group size compiles once); their prompts are
        prefilled chunk by chunk by `_prefill`."""
        cache = self.cache
        copies: list[tuple[Request | None, int, int, int]] = []  # (request or None: a move, src, dst, columns)
        with self.lock:
            free = [s for s in range(self.slots) if s not in self.busy]
            if not free or not self.waiting:
                return
            # prompts whose KV is being computed (a later request sharing their prefix waits for it)
            pending = [np.asarray(r.ids) for g in self._prefilling for r in g.reqs] if cache.enabled else []
            decoding = [(s, np.asarray(r.ids)) for s, r in self.busy.items() if r.decoding and not r.cancelled]
            shift = self.prop.shift if self.prop is not None else 0
            reqs = []
            # the first few waiting requests only: the scan runs every iteration, and a long queue
            # would make it slow (those behind wait no longer than the prefills in progress)
            for r in list(itertools.islice(self.waiting, 4 * self.slots)):
                if not free:
                    break
                ids = np.asarray(r.ids)
                src, m = cache.lookup(ids, decoding)
                if any(common_prefix(ids, p) >= m + cache.min_reuse for p in pending):
                    continue
                self.waiting.remove(r)
                slot = cache.pick_slot(free, src, self.busy)
                free.remove(slot)
                r.slot = slot
                self.busy[slot] = r
                if src is not None:
                    cache.touch(src)
                # the draft's entry p holds token p + shift: the last `shift` cached positions are recomputed
                r._reuse = max(m - shift, 0) if src == slot or m - shift >= cache.min_reuse else 0
                moved = cache.take(slot, src, free)  # the slot's own prefix, kept in a less useful slot
                if moved is not None:
                    copies.append((None, slot, *moved))
                if r._reuse and src is not None and src != slot:
                    copies.append((r, src, slot, r._reuse))
                pending.append(ids)
                reqs.append(r)
        for owner, src, dst, cols in copies:  # in order: a slot is read before it is overwritten
            who = [] if owner is None else [owner]
            if not self._guarded("copying a cached prefix", who, lambda a=(src, dst, cols): self._copy(*a)):
                if owner is None:
                    self.forget([dst], 0)
                elif owner in reqs:
                    reqs.remove(owner)
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

    def _copy(self, src: int, dst: int, columns: int) -> None:
        """The KV of the first `columns` positions of slot src into slot dst (copy_prefix)."""
        prog = self.programs.get(("copy",))
        self._seq += 1
        self._admit_seq = self._seq
        self.batch = prog(self.batch, jnp.int32(src), jnp.int32(dst), jnp.int32(columns))

    def _new_group(self, reqs: list[Request]) -> PrefillGroup:
        length, start = max(len(r.ids) for r in reqs), min(r._reuse for r in reqs)
        progs = self.programs
        plan = progs.prefill_plan(len(reqs), length, start=start)
        ideal = progs.prefill_plan(len(reqs), length, exact=True, start=start)
        assert ideal is not None
        if plan is None:  # nothing compiled covers it: the ideal shapes, compiled at first use
            plan = ideal
        elif plan[2] != ideal[2]:
            # served by larger chunks, or from an earlier position (a cached prompt's tail
            # recomputed through a 256-token chunk): its own programs, compiled in the background
            for key in ideal[2]:
                progs.want(key)
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
            eng.models,
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
            eng.models,
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

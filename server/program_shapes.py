"""Which program shapes the server compiles, and which compiled program serves a call.

The scheduler runs four programs (jaxspec/serving.py), each specialised on a few static sizes:

  ("chunk", n, C, span)     admit_chunk: one prefill chunk of C tokens for n new requests
  ("finish", n)             admit_finish: their first tokens (its draft extension reads every column)
  ("copy",)                 copy_prefix: a cached prompt prefix's KV columns into a new
                            request's slot (prefix caching)
  ("dispatch", n_act, span, sampled, shape, logprobs, grammar)
                            dispatch: k rounds for slots [0, n_act); sampled=False is a
                            greedy-only program (no sampler), True serves any mix; shape: the
                            tree shape's label (speculative/adaptive.py shape_label; "off" is
                            plain decoding), the configured one or another candidate of
                            adaptive speculation (a shallower tree, or plain steps);
                            logprobs=True also computes the emitted tokens' logprobs (for
                            requests that ask; it serves the others too, a little slower);
                            grammar=True masks tokens by constrained requests' grammars (host
                            callbacks, jaxspec/grammar.py); only such dispatches use it

`span` is how many KV columns attention reads: one of `spans()` (64, 256, 1024, .. up to the
context on a CPU). A program for a larger n_act, C or span than a call needs is still correct (extra slots are stopped, extra columns are masked, a chunk is zero-padded),
only slower, and a sampled=True dispatch serves greedy slots too (on CPU at no extra cost: its
sampler is skipped for a call with no drawing slot, jaxspec/sampling.py SKIP_UNUSED, so there
no greedy-only programs are compiled ahead). So no request has to wait for
XLA: start-up compiles a *cover* set that serves any request within --context-length and
--max-running-requests (`startup_keys`: prefill at every span, decoding at every span for one
slot and for all of them, all sampled=True, one logprobs=True program at the largest shape, and two
logprobs=True grammar=True programs for constrained requests, at the largest short span and the
largest), and a background thread then compiles every other shape (`background_keys`, most useful
first: with adaptive speculation, the twins of the start-up dispatches for its other candidates,
then the greedy-only twins of the start-up dispatches). Each call takes the cheapest program
compiled so far that covers it (`dispatch_key`, `prefill_plan`; adaptive speculation runs another
candidate only once a program of that candidate covers the call).

These rules are `ProgramShapes`; server/programs.py's `Programs` inherits them and does the
compiling: ahead of time, in the background within budgets, and on first use.
"""

from __future__ import annotations

from typing import Any

from jaxspec.requests import bucket
from jaxspec.sampling import skips_unused
from jaxspec.speculative.adaptive import OFF

SHORT_CHUNK = 64  # the smallest prefill chunk (or --chunked-prefill-size if smaller)


def chunk_cost(key: tuple) -> float:
    """A prefill chunk program's relative cost, ("chunk", n, C, span) -> n x C x (1 + span / 2048):
    its rows through the weights plus attention over the span (two SmolLM2 chunks on the 2-core CPU:
    C = 64 at span 64 took 117 ms, C = 512 at span 1024 1,240 ms)."""
    return key[1] * key[2] * (1 + key[3] / 2048)


class ProgramShapes:
    """The shape keys of one Scheduler's programs (see the module docstring) and the choice among
    the compiled ones; the compiling, and `_have`, are server/programs.py's `Programs`."""

    sched: Any  # the Scheduler
    lazy: bool  # --disable-cuda-graph: compile on first use only
    startup_bs: int  # the batch sizes the start-up set covered exactly

    def _have(self) -> list[tuple]:
        """The keys compiled so far."""
        raise NotImplementedError

    # ---- shapes --------------------------------------------------------------------------------

    def spans(self) -> list[int]:
        """The KV spans programs are compiled for: min_span times powers of four, then max_len (the
        context plus the round's scratch columns), which replaces the span just below it when it
        is within a quarter of it (a context of 8192 reads 8256 columns: one set of programs for
        both, not two). Steps of four, not two: half as many programs, each a few tens of MB of
        host memory on a CPU, for attention over at most 4x the columns a call needs (the weights,
        read once per step whatever the span, dominate short spans)."""
        s = self.sched
        out, x = [], s.min_span
        while x < s.max_len:
            out.append(x)
            x *= 4
        if len(out) > 1 and s.max_len * 4 <= out[-1] * 5:
            out.pop()
        return out + [s.max_len]

    def span_for(self, need: int) -> int:
        """The smallest of spans() that is >= need (max_len for anything longer)."""
        return next((x for x in self.spans() if x >= need), self.sched.max_len)

    def sizes(self, up_to: int | None = None) -> list[int]:
        cap = min(up_to or self.sched.slots, self.sched.slots)
        out, n = [], 1
        while n <= cap:
            out.append(n)
            n *= 2
        if self.sched.slots not in out and up_to is None:
            out.append(self.sched.slots)
        return out

    def chunk_sizes(self) -> list[int]:
        """Prefill chunk sizes: powers of two from min(64, top) to top = --chunked-prefill-size rounded up."""
        top = bucket(self.sched.eng.chunked_prefill_size)
        out, c = [], min(SHORT_CHUNK, top)
        while c <= top:
            out.append(c)
            c *= 2
        return out

    def chunk_for(self, span: int) -> int:
        """The prefill chunk whose programs are compiled at `span`: prompts of up to the top chunk are
        prefilled in one chunk of their own power of two, longer ones in top-size chunks."""
        return min(span, self.chunk_sizes()[-1])

    def startup_keys(self, max_bs: int) -> list[tuple]:
        """The cover set: every prompt length's prefill (for one request at a time; the uncached
        tail of a prompt whose prefix is cached too), decoding at every span for batch sizes 1, 2,
        4, .. up to max_bs and for all the slots (a call of n_act slots runs the smallest of them
        >= n_act), and with adaptive speculation plain steps for all the slots at spans up to 1024
        (where a busy server turns speculation off). With prefix caching, the prefix copy.
        At the short spans (chat prompts) a prompt is prefilled by its own chunk, not by the span's
        largest: each chunk size longer than the span below, and with prefix caching the smallest
        (a cached prompt's tail). Through the largest, a 65-128-token prompt took 200 ms to its
        first dispatch instead of 70, in a server whose background compiles had stopped before
        compiling its own."""
        s = self.sched
        spans = self.spans()
        short = [x for x in spans if x <= 512] or spans[:1]
        keys: list[tuple] = [("finish", 1)]
        keys += [("chunk", 1, self.chunk_for(x), x) for x in spans]
        sizes = self.chunk_sizes()
        tail = sizes[0] if s.cache.enabled else None
        for below, x in zip([0, *short], short):
            keys += [("chunk", 1, c, x) for c in sizes if c <= self.chunk_for(x) and (c > below or c == tail)]
        if s.cache.enabled:
            keys.append(("copy",))
        main = s.main_shape
        for n in sorted(set(self.sizes(max_bs)) | {s.slots}):
            keys += [("dispatch", n, x, True, main, False, False) for x in spans]
        if OFF in s.shapes and OFF != main:
            keys += [("dispatch", s.slots, x, True, OFF, False, False) for x in spans if x <= 1024]
        keys.append(
            ("dispatch", s.slots, s.max_len, True, main, True, False)
        )  # covers every request asking for logprobs
        if s.grammar:  # constrained requests (with or without logprobs): short ones, and every other
            keys += [("dispatch", s.slots, x, True, main, True, True) for x in (short[-1], s.max_len)]
        return list(dict.fromkeys(keys))

    def background_keys(self) -> list[tuple]:
        """Every other shape, most useful first: one request at every span, then every batch size,
        then admission of several requests at once (bursts of short prompts). With adaptive
        speculation, the twins of the start-up dispatches for plain steps come first (without them
        it cannot choose), then the smallest prefill chunk at every span (a cached prompt's tail),
        then the twins for the shallower tree and the greedy-only twins of the start-up dispatches
        (none on CPU, see the module docstring); the twins of the others come last, and the
        logprob programs for one request at each short span after them. The list may be cut short
        by MAP_BUDGET or the program memory budget (server/programs.py), so the most useful come
        first."""
        spans, sizes, main = self.spans(), self.sizes(), self.sched.main_shape
        startup = [k for k in self.startup_keys(self.startup_bs) if k[0] != "dispatch" or not k[5]]
        # greedy-only twins: not where the sampling programs skip their sampler for greedy calls (CPU)
        greedy = lambda ks: [] if skips_unused() else [k[:3] + (False,) + k[4:] for k in ks if k[0] == "dispatch"]
        others = [x for x in reversed(self.sched.shapes) if x != main]  # plain steps, then shallower trees
        twins = lambda ks, shapes=others: [k[:4] + (x,) + k[5:] for x in shapes for k in ks if k[0] == "dispatch"]
        # plain steps' twins first (adaptive speculation cannot choose without them), then the
        # smallest chunk at every span (a cached prompt's tail: multi-turn chats), then the
        # shallower trees' twins, which adaptive speculation chooses least often
        keys = twins(startup, others[:1])
        if self.sched.cache.enabled:
            keys += [("chunk", 1, self.chunk_sizes()[0], x) for x in spans]
        keys += twins(startup, others[1:]) + greedy(startup)
        rest = [("dispatch", 1, x, True, main, False, False) for x in spans]
        rest += [("dispatch", n, x, True, main, False, False) for x in spans for n in sizes]
        keys += rest
        # tiny prompts under a large min span
        keys += [("chunk", 1, c, spans[0]) for c in self.chunk_sizes() if c < spans[0]]
        for n in sizes[1:]:
            keys.append(("finish", n))
            keys += [("chunk", n, self.chunk_for(x), x) for x in spans if x <= 512]
        keys += greedy(rest)
        keys += twins(greedy(startup) + rest + greedy(rest))
        keys += [("dispatch", 1, x, True, main, True, False) for x in spans if x <= 512]
        return [k for k in dict.fromkeys(keys) if k not in self._have()]

    # ---- choosing ------------------------------------------------------------------------------

    def dispatch_key(
        self,
        n_act: int,
        span: int,
        sampled: bool = True,
        shape: str | None = None,
        logprobs: bool = False,
        grammar: bool = False,
    ) -> tuple | None:
        """The cheapest compiled ("dispatch", n', span', s', shape, l') with n' >= n_act, span' >= span,
        s' >= sampled (a sampling program serves greedy slots, at the cost of its sampler) and
        l' >= logprobs, and grammar as asked. shape: a label of sched.shapes (default: the configured one). When no
        compiled program covers the call: the exact key for the configured shape (compiled now;
        a sampling one on CPU, where it serves greedy calls as fast, except with --disable-cuda-graph,
        where each call compiles its own kind: a greedy-only program compiles faster), None for
        another candidate of adaptive speculation (the configured shape serves the call instead)."""
        shape = self.sched.main_shape if shape is None else shape
        exact = ("dispatch", n_act, span, sampled or (skips_unused() and not self.lazy), shape, logprobs, grammar)
        have = [
            k
            for k in self._have()
            if k[0] == "dispatch"
            and k[1] >= n_act
            and k[2] >= span
            and k[3] >= sampled
            and k[4] == shape
            and k[5] >= logprobs
            and k[6] == grammar
        ]
        if self.lazy or exact in have:
            return exact
        if not have:
            return exact if shape == self.sched.main_shape else None
        return min(have, key=lambda k: (k[5], k[1] * (1024 + k[2]), k[3]))

    def finish_sizes(self) -> list[int]:
        return sorted(k[1] for k in self._have() if k[0] == "finish")

    def prefill_plan(
        self, n: int, length: int, exact: bool = False, start: int = 0
    ) -> tuple[int, int, list[tuple]] | None:
        """(C, first position, chunk keys) to prefill positions [start, length) of n prompts of at
        most `length` tokens (those before `start` are cached), or None if no compiled programs do
        it. exact (or a lazy store): the ideal chunk (the power of two of the positions left, at
        most the prefill chunk size) from `start`, compiled or not. Otherwise compiled programs
        from `start`, the last chunk padded past `length`: the ideal chunk, else the smallest
        chunks, each at the smallest span compiled; or, where it is cheaper by chunk_cost, chunks
        from an earlier position, recomputing cached positions so that programs of a shorter span
        serve (a cached prompt's last token: one small chunk from the start of the KV region
        rather than a long chunk over a long span, when the small chunk at the long span is not
        compiled). Chunks never run past the KV region (they start earlier instead)."""
        s = self.sched
        sizes = self.chunk_sizes()
        ideal = min(sizes[-1], max(sizes[0], bucket(length - start)))
        have = {k for k in self._have() if k[0] == "chunk" and k[1] == n}
        spans = sorted({k[3] for k in have})

        def plan(c: int, first: int) -> tuple[float, int, int, list[tuple]] | None:
            """(cost, C, first position, keys) of chunks of C from `first` (earlier where they would
            run past the KV region), or None where a chunk has no compiled program."""
            count = -(-(length - first) // c)
            first = max(0, min(first, s.max_len - count * c))
            keys = []
            for i in range(count):
                need = s._span(first + i * c + c)
                if self.lazy or exact:
                    keys.append(("chunk", n, c, need))
                    continue
                cands = [k for k in have if k[2] == c and k[3] >= need]
                if not cands:
                    return None
                keys.append(min(cands, key=lambda k: k[3]))
            return sum(map(chunk_cost, keys)), c, first, keys

        if self.lazy or exact:
            return plan(ideal, start)[1:]  # type: ignore[index]  # (never None here)
        best = None
        for c in [ideal] + [c for c in sorted({k[2] for k in have}) if c != ideal]:  # from `start`
            best = plan(c, start)
            if best is not None:
                break
        for c in sorted({k[2] for k in have}):  # from earlier, where that is cheaper
            count = -(-(length - start) // c)
            # the latest start first: on a tie, fewer cached positions recomputed
            for first in sorted({min(start, x - m * c) for x in spans for m in range(1, count + 1)}, reverse=True):
                alt = plan(c, first) if 0 <= first < start else None
                if alt is not None and (best is None or alt[0] < best[0]):
                    best = alt
        return None if best is None else best[1:]

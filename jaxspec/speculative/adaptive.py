"""Adaptive speculation: how far to speculate, chosen between blocks of rounds from what was measured.

Candidates: the configured tree shape, a shallower one (half the draft steps, `shallower`), and no
speculation (plain decoding steps that keep the draft up to date, `loop.plain_steps`). All are
lossless, so the choice changes speed only. Before each block of BLOCK_ROUNDS rounds, or of
OFF_BLOCK_ROUNDS plain steps (the offline engine, `Adaptive.run`), or each dispatch (the server,
which feeds `observe_cost` / `observe_acceptance` itself) the candidate with the most expected
tokens per second for the requests still running is run:

    value(shape) = sum over running requests of E[tokens per round | shape, request] / cost(shape, B)

cost: seconds per round of (shape, batch size B, span S, sampled) of the program that would run it
(the server runs a call through the cheapest compiled program that covers it, whose batch size and
KV span may be larger than the call's, and a sampling program may serve greedy calls; the offline
engine has one span, 0, and one kind), the median over the last COST_SAMPLES blocks that did not
compile (a median, so that one slow block, e.g. a busy machine, does not decide), each block
weighted by its recency (half the weight every COST_HALF_LIFE seconds older than the shape's newest
block: a candidate not chosen is measured only by its trials, below, and one trial then outweighs
samples taken while the machine ran slower, e.g. during a server's first requests); at a batch size
not yet measured twice, interpolated from the batch sizes that were at the same span and kind (or
the nearest span measured, of the same kind first).
E[tokens per round]: 1 without speculation; with d draft steps 1 + sum_{j <= d} P(accepted >= j),
P(accepted >= j) = prod_{i <= j} P(depth i accepted | depth i - 1 was), each factor counted over
the rounds that reached depth i (a product-limit estimate: rounds of a shallower shape say nothing
about deeper depths), from the request's own rounds plus, as a prior worth PRIOR_ROUNDS rounds
(the server: SERVER_PRIOR_ROUNDS), those of earlier requests of the same kind (greedy or sampled).
The server weighs the prior more: its dispatches run 2 rounds on a CPU, a request's own estimate
moves with every few of them, and a dip below the plain steps' break-even (they teach the estimate
nothing) held a request on plain steps where the tree would have served it faster. On 32 MT-bench
requests per level it served 1.17x / 1.02x plain at concurrency 1 (T = 0 / 1) with PRIOR_ROUNDS and
1.20x / 1.12x with SERVER_PRIOR_ROUNDS; static speculation, 1.25x / 1.05x. Rounds of every tree
shape are pooled per depth (an approximation when their widths differ). A margin settles near-ties, and
which side it favours was measured for each user of the choice:
  the server (SERVER_MARGIN) speculates only where the best shape is expected to be 5% faster than
    plain steps: what the estimates leave out (a dispatch's host work, admissions waiting behind
    longer dispatches, the trials below) falls on speculation's side, and at temperature 0 the
    server lost 9% running the tree where it expected 0-5% more than plain steps;
  the offline engine (OFFLINE_MARGIN) stops speculating only where plain steps are expected to be
    5% faster: a block there holds no other work, the acceptance estimate runs low early in a
    request, and the server's rule cost it 7-9% against static speculation on MT-bench.
Trials: a candidate not chosen is tried again after EXPLORE_MIN blocks, an interval that doubles
(up to EXPLORE_MAX) each time the trial confirms the choice and starts again from EXPLORE_MIN once
the candidate is chosen. The configured shape is always tried so: a trial measures its acceptance,
which a shape not chosen otherwise learns nothing of. The server (`retry_all`) tries every other
candidate too, plain steps included: its costs are measured beside changing load (admissions,
prefill chunks, other requests' lengths), and a cost measured once while it ran slow stayed, with
the tree chosen at every dispatch of a level where it served 0.88x plain steps. Offline, blocks run
alone and their costs are steady, and a trial of plain steps there is a block of OFF_BLOCK_ROUNDS.
A trial lasts at least TRIAL_ROUNDS rounds (one block offline; several of the server's dispatches
of a few rounds each), so that it measures more than one cost sample and a request's acceptance
over more than its first, noisy rounds.
Only candidates with a compiled program are chosen: the server compiles them in the background
after start-up, the offline engine (`Adaptive.run`) in a background thread when it meets a new
batch / buffer / cache size, once the configured shape's first blocks have been timed.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import numpy as np

from jaxspec.config import SpecConfig, tree_capacity

# rounds per block of a tree shape (the offline engine): between blocks the host reads the state and
# chooses, and the device waits; on MT-bench (2-core CPU) blocks of 8 ran 1-2% below static
# speculation at the same shape, blocks of 16 within 0.5%
BLOCK_ROUNDS = 16
# plain steps per block without speculation (the offline engine): a block has a fixed cost (its
# dispatch, the host's look at the state, the draft's catch-up over the block's tokens), 3.8 ms a
# block under gguf on a 2-core CPU, where 8 plain steps cost 7.5% more than plain decoding and 32 1.4%
OFF_BLOCK_ROUNDS = 32
PRIOR_ROUNDS = 16.0  # a request's own rounds outweigh the prior once it has run more than this many
SERVER_PRIOR_ROUNDS = 64.0  # the server's (see the module docstring)
PRIOR_DECAY = 0.98  # per block: the prior follows the last few hundred rounds
COST_SAMPLES = 8  # a round's cost is the median of the last this many blocks' (once there are 2)
COST_HALF_LIFE = 2.0  # seconds: a block's weight in that median halves per this much older than the newest
# how much faster speculation must be expected to be than plain steps to run (negative: how much
# faster plain steps must be expected to be to stop it); see the module docstring
SERVER_MARGIN = 0.05
OFFLINE_MARGIN = -0.05
EXPLORE_MIN, EXPLORE_MAX = 4, 64
TRIAL_ROUNDS = 8  # a trial of the configured shape runs at least this many rounds
OFF = "off"

logger = logging.getLogger("jaxspec")

# Background compiles (Adaptive._compile_ahead) still running, and the flag that stops them at exit:
# a compile cut off by interpreter shutdown aborts the process, so exit waits for the one under way.
_THREADS: set[threading.Thread] = set()
_EXITING = threading.Event()


@atexit.register
def _finish_compiles() -> None:
    _EXITING.set()
    for thread in list(_THREADS):
        thread.join()


def shape_label(spec: SpecConfig | None) -> str:
    """'num_steps/topk/num_draft_tokens' (+ '+M' with M text-match candidates), or 'off' (no speculation)."""
    if spec is None:
        return OFF
    text = f"+{spec.suffix_nodes}" if spec.suffix is not None else ""
    return f"{spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}{text}"


def shallower(spec: SpecConfig) -> SpecConfig | None:
    """The configured shape with half its draft steps (at least one) and no more nodes than those
    steps can fill, or None when it has a single step."""
    d = spec.num_steps // 2
    if d < 1:
        return None
    return dataclasses.replace(
        spec, num_steps=d, num_draft_tokens=min(spec.num_draft_tokens, tree_capacity(d, spec.eagle_topk))
    )


@dataclasses.dataclass
class Adaptive:
    """The choice and what it is made from; one per engine (or server), kept across requests.
    Per-request acceptance is an array acc [R, 2, D]: per depth 1 .. D, rounds that reached it
    (tried) and rounds that accepted it (passed)."""

    spec: SpecConfig
    margin: float = OFFLINE_MARGIN  # SERVER_MARGIN for the server
    rounds: int = BLOCK_ROUNDS  # rounds per block of a tree shape (the server: per dispatch)
    off_rounds: int = OFF_BLOCK_ROUNDS  # plain steps per block without speculation
    prior_rounds: float = PRIOR_ROUNDS  # the prior's weight in a request's acceptance, in rounds
    # (label, B, S, sampled) -> seconds per round of the last blocks
    cost: dict[tuple[str, int, int, bool], list[float]] = dataclasses.field(default_factory=dict)
    # the same keys -> when each of those blocks ended (time.monotonic()); a list absent: all equally recent
    cost_at: dict[tuple[str, int, int, bool], list[float]] = dataclasses.field(default_factory=dict)
    compiled: set[tuple] = dataclasses.field(default_factory=set)  # program signatures run at least once
    # program signatures compiled ahead (offline engine, `run`): those a block may run without waiting
    ready: set[tuple] = dataclasses.field(default_factory=set)
    _compiling: dict[tuple, threading.Thread] = dataclasses.field(default_factory=dict)
    # greedy / sampled -> [2, D] acceptance of earlier requests' rounds (decayed)
    prior: dict[bool, np.ndarray] = dataclasses.field(default_factory=dict)
    retry_all: bool = False  # trials of every candidate not chosen, not only of the configured shape
    explore_gap: dict[str, int] = dataclasses.field(default_factory=dict)  # label -> blocks between trials
    since_explore: dict[str, int] = dataclasses.field(default_factory=dict)  # label -> blocks since it ran
    trial: str | None = None  # the label of the candidate under trial
    trial_left: int = 0  # blocks the trial under way still runs after this one

    def block_rounds(self, spec: SpecConfig | None) -> int:
        """Rounds (plain steps without speculation) in a block of `spec` (the offline engine)."""
        return self.rounds if spec is not None else self.off_rounds

    @functools.cached_property
    def candidates(self) -> list[SpecConfig | None]:
        """The configured shape first, no speculation last. With text-match candidates, the draft's
        tree alone too (and the shallower shape without them): where the text does not repeat,
        their rows in the target forward cost more than they return."""
        if self.spec.suffix is None:
            half = shallower(self.spec)
            return [self.spec] + ([half] if half is not None else []) + [None]
        alone = self.spec.without_text()
        half = shallower(alone)
        return [self.spec, alone] + ([half] if half is not None else []) + [None]

    def index(self, spec: SpecConfig | None) -> int:
        return [shape_label(c) for c in self.candidates].index(shape_label(spec))

    def _pool(self, spec: SpecConfig | None) -> slice:
        """Where a shape's acceptance is kept in the per-depth arrays: rounds with text-match
        candidates apart from rounds without (they accept far deeper where the text repeats)."""
        d = self.spec.depth
        return slice(d, 2 * d) if spec is not None and spec.suffix is not None else slice(0, d)

    @property
    def width(self) -> int:
        """Columns of the acceptance arrays: D per pool (one, or two with text-match candidates)."""
        return self.spec.depth * (2 if self.spec.suffix is not None else 1)

    def empty(self, n: int = 0) -> np.ndarray:
        """Acceptance counts [n, 2, width] of requests that have run no round."""
        return np.zeros((n, 2, self.width))

    def expected_tokens(self, acc: np.ndarray, greedy: np.ndarray, spec: SpecConfig | None = None) -> np.ndarray:
        """acc [R, 2, width] per-request acceptance counts, greedy [R] bool -> E[tokens per round] [R]
        of the tree shape `spec` (default: the configured one), from its pool."""
        spec = self.spec if spec is None else spec
        pool = self._pool(spec)
        start = np.stack([np.ones(self.width), np.full(self.width, 0.5)])  # none seen yet
        prior = np.stack([self.prior.get(bool(g), start) for g in greedy])[:, :, pool]  # [R, 2, D]
        cond0 = np.where(prior[:, 0] > 0, prior[:, 1] / np.maximum(prior[:, 0], 1e-9), 0.5)
        w = self.prior_rounds
        cond = (acc[:, 1, pool] + w * cond0) / (acc[:, 0, pool] + w)
        return 1.0 + np.cumprod(cond, -1)[:, : spec.depth].sum(-1)

    def choose(
        self,
        batch: int,
        acc: np.ndarray,
        greedy: np.ndarray,
        n_plain: int = 0,
        allowed: Collection[str] | Mapping[str, tuple[int, int, bool]] | None = None,
    ) -> SpecConfig | None:
        """The candidate for the next block; acc: [R, 2, D] and greedy [R] of the running
        speculative requests; n_plain: running requests that never speculate (one token per round
        either way); allowed: the labels of the candidates that can run now (the server: those with
        a compiled program for this call; the configured shape always can), default all; as a
        mapping, label -> (batch size, span, sampled) of the program each would run with (its
        cost is looked up there instead of at (batch, 0, False))."""
        where = allowed if isinstance(allowed, Mapping) else {}
        cands = [c for c in self.candidates if c is self.spec or allowed is None or shape_label(c) in allowed]
        if len(acc) == 0:
            return None if None in cands else self.spec
        for c in cands:  # measure every candidate's cost first (at some batch size), the configured shape first
            if not self._timed(c):
                return c
        under_trial = [c for c in cands if shape_label(c) == self.trial]
        if self.trial_left > 0 and under_trial:  # a trial goes on (while its candidate can run)
            self.trial_left -= 1
            return under_trial[0]

        def tokens(c):
            return len(acc) if c is None else self.expected_tokens(acc, greedy, c).sum()

        def rate(c):
            return (tokens(c) + n_plain) / cost(c)

        def cost(c):
            return self.round_cost(c, *where.get(shape_label(c), (batch, 0)))

        best = max([c for c in cands if c is not None], key=rate)
        pick = None if None in cands and self.plain_wins(rate(best), rate(None)) else best
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "adaptive: batch %d, %s -> %s",
                batch,
                ", ".join(
                    f"{shape_label(c)} {cost(c) * 1e3:.1f} ms/round x {tokens(c) / len(acc):.2f} tokens {rate(c):.1f} tok/s"
                    for c in cands
                ),
                shape_label(pick),
            )
        if self.trial is not None and self.trial != shape_label(pick):  # the trial confirmed: look less often
            self.explore_gap[self.trial] = min(2 * self.explore_gap.get(self.trial, EXPLORE_MIN), EXPLORE_MAX)
        self.trial, self.trial_left = None, 0
        self.since_explore[shape_label(pick)], self.explore_gap[shape_label(pick)] = 0, EXPLORE_MIN
        run = pick  # the chosen candidate, or one whose trial starts now
        for c in cands:
            label = shape_label(c)
            if c is pick or not (c is self.spec or self.retry_all):
                continue
            self.since_explore[label] = self.since_explore.get(label, 0) + 1
            if self.trial is None and self.since_explore[label] > self.explore_gap.get(label, EXPLORE_MIN):
                self.since_explore[label], self.trial = 0, label
                self.trial_left = -(-TRIAL_ROUNDS // max(self.rounds, 1)) - 1
                run = c
        return run

    def plain_wins(self, best: float, plain: float) -> bool:
        """Whether plain steps (expected tokens/s `plain`) run rather than the best tree shape
        (`best`), by the margin."""
        if self.margin >= 0:
            return best <= plain * (1 + self.margin)
        return plain > best * (1 - self.margin)

    def observe_cost(
        self,
        spec: SpecConfig | None,
        batch: int,
        seconds: float,
        rounds: int,
        sig: tuple,
        span: int = 0,
        sampled: bool = False,
        at: float | None = None,
    ) -> None:
        """A block of `rounds` rounds of `spec` by a program of batch size `batch`, KV span `span`
        and kind `sampled` (a sampling program, or greedy-only) took `seconds`, ending at `at`
        (time.monotonic(); default now). sig: the compiled program that ran it; its first run
        (compiling, setting up) is not a cost sample."""
        if sig in self.compiled and rounds > 0:
            key = (shape_label(spec), batch, span, sampled)
            self.cost[key] = [*self.cost.get(key, []), seconds / rounds][-COST_SAMPLES:]
            at = time.monotonic() if at is None else at
            self.cost_at[key] = [*self.cost_at.get(key, []), at][-len(self.cost[key]) :]
        self.compiled.add(sig)

    def _cost_of(self, key: tuple[str, int, int, bool]) -> float:
        """Seconds per round at `key`: the median of its samples, each weighted by its recency
        (COST_HALF_LIFE; with equal weights, numpy's median)."""
        x = np.asarray(self.cost[key], np.float64)
        at = self.cost_at.get(key)
        if at is None or len(at) != len(x):
            return float(np.median(x))
        w = 0.5 ** ((max(at) - np.asarray(at, np.float64)) / COST_HALF_LIFE)
        order = np.argsort(x, kind="stable")
        x, cum = x[order], np.cumsum(w[order])
        half = cum[-1] / 2
        lo = int(np.searchsorted(cum, half * (1 - 1e-9)))  # the first sample reaching half the weight
        hi = int(np.searchsorted(cum, half * (1 + 1e-9), side="right"))  # the first past it (a tie: both)
        return float((x[lo] + x[min(hi, len(x) - 1)]) / 2)

    def observe_acceptance(
        self, block_hist: np.ndarray, greedy: np.ndarray, depth: int, spec: SpecConfig | None = None
    ) -> np.ndarray:
        """block_hist [R, D + 1]: rounds of a block of a shape accepting at most `depth` drafts that
        accepted 0 .. D drafts, per request; greedy [R]; spec: the shape (its pool; default: the one
        without text matches). Adds them to the prior of each kind; returns their acceptance counts
        [R, 2, width]."""
        surv = np.cumsum(block_hist[:, ::-1], axis=1)[:, ::-1].astype(np.float64)  # rounds that accepted >= j
        reached = np.arange(1, self.spec.depth + 1) <= depth
        pool = self._pool(spec)
        acc = np.zeros((len(block_hist), 2, self.width))
        acc[:, :, pool] = np.stack([surv[:, :-1] * reached, surv[:, 1:] * reached], 1)
        for g in (False, True):
            total = acc[greedy == g].sum(0)
            if total[0, pool][0] > 0:
                prior = self.prior.get(g, np.zeros_like(total))
                prior[:, pool] = total[:, pool] + PRIOR_DECAY * prior[:, pool]
                self.prior[g] = prior
        return acc

    def _compile_ahead(self, precompile: Callable[[SpecConfig | None], Any], signature: tuple) -> None:
        """Compiles, one after another in a background thread at low CPU priority, the candidates
        (all but the configured shape) not yet compiled for `signature`; each is added to `ready`
        when its compile is done."""
        todo = [
            c
            for c in self.candidates[1:]
            if (shape_label(c), *signature) not in self.ready and (shape_label(c), *signature) not in self._compiling
        ]
        if not todo:
            return

        def work():
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # decoding goes first
            except (AttributeError, OSError):  # pragma: no cover - not Linux
                pass
            try:
                for c in todo:
                    key = (shape_label(c), *signature)
                    try:
                        if not _EXITING.is_set():
                            precompile(c)
                            self.ready.add(key)
                    except Exception as e:  # the candidate stays unused; decoding goes on
                        logger.warning("adaptive speculation: compiling %s failed: %s", shape_label(c), e)
                    finally:
                        self._compiling.pop(key, None)
            finally:
                _THREADS.discard(threading.current_thread())

        thread = threading.Thread(target=work, name="jaxspec-adaptive-compile", daemon=True)
        for c in todo:
            self._compiling[(shape_label(c), *signature)] = thread
        _THREADS.add(thread)
        thread.start()

    def _timed(self, spec: SpecConfig | None) -> bool:
        """Whether `spec` was measured at least twice somewhere (its cost is known)."""
        label = shape_label(spec)
        return any(k[0] == label and len(v) >= 2 for k, v in self.cost.items())

    def _measured(self, spec: SpecConfig | None) -> dict[tuple[int, int, bool], float]:
        """(batch size, span, sampled) -> median seconds per round of `spec`, where measured at least twice."""
        label = shape_label(spec)
        return {k[1:]: self._cost_of(k) for k, v in self.cost.items() if k[0] == label and len(v) >= 2}

    def round_cost(self, spec: SpecConfig | None, batch: int, span: int = 0, sampled: bool = False) -> float:
        """Seconds per round of `spec` at (`batch`, `span`, `sampled`): the (recency-weighted)
        median of its samples there, else interpolated linearly between the nearest batch sizes measured below and above
        at that span and kind (the nearest one when on one side only; when none was measured there,
        at the nearest span measured of the same kind if any, the larger span on a tie). Every batch
        size is thus chosen for from the first one measured: with requests finishing one by one a
        server meets many batch sizes, and measuring each candidate at each of them first kept it
        on the configured shape for most of its dispatches."""
        key = (shape_label(spec), batch, span, sampled)
        if len(self.cost.get(key, [])) >= 2:
            return self._cost_of(key)
        measured = self._measured(spec)
        near = min(
            {k[1:] for k in measured}, key=lambda k: (k[1] != sampled, abs(np.log2(max(k[0], 1) / max(span, 1))), -k[0])
        )
        known = {b: v for (b, *k), v in measured.items() if tuple(k) == near}
        if batch in known:
            return known[batch]
        lo = max((b for b in known if b < batch), default=None)
        hi = min((b for b in known if b > batch), default=None)
        if lo is None or hi is None:
            return known[hi if lo is None else lo]  # type: ignore[index]  # (one of them is set: known is not empty)
        return known[lo] + (known[hi] - known[lo]) * (batch - lo) / (hi - lo)

    def run(
        self,
        block: Callable[[SpecConfig | None, Any], Any],
        state,
        greedy: np.ndarray,
        signature: tuple,
        precompile: Callable[[SpecConfig | None], Any] | None = None,
    ):
        """Runs blocks on `state` (a SpecState of which rows [0, n) are requests; greedy [n] bool)
        until every request is done. block(spec, state) -> state runs one block. signature: what
        else the compiled programs depend on (batch, buffer and cache sizes, sampled).
        precompile(spec): compiles (once; later calls return it) the block program of `spec` for this
        signature without running it; given, the candidates other than the configured shape are
        compiled in a background thread for each new signature (once the configured shape's round
        cost at this batch size is known: short requests compile nothing more) and chosen only once
        compiled, so that no block waits for a compile the configured shape would not have needed.
        Returns (state, rounds [n, len(candidates)] that each request ran with each candidate)."""
        n = len(greedy)
        batch = int(state.last.shape[0])
        used = np.zeros((n, len(self.candidates)), np.int64)
        acc = self.empty(n)
        vct, hist = (np.asarray(x) for x in jax.device_get((state.verify_ct, state.hist)))
        done = np.asarray(jax.device_get(state.done))
        while not done[:n].all():
            running = ~done[:n]
            allowed = None
            if precompile is not None:
                # once the configured shape has been timed here (a short request compiles nothing more)
                if len(self.cost.get((shape_label(self.spec), batch, 0, False), [])) >= 2:
                    self._compile_ahead(precompile, signature)
                allowed = {shape_label(c) for c in self.candidates if (shape_label(c), *signature) in self.ready}
            c = self.choose(batch, acc[running], greedy[running], allowed=allowed)
            sig = (shape_label(c), *signature)
            busy = bool(self._compiling)
            t = time.perf_counter()
            state = block(c, state)
            self.ready.add(sig)
            done, vct2, hist2 = (np.asarray(x) for x in jax.device_get((state.done, state.verify_ct, state.hist)))
            took = (vct2 - vct)[:n]
            # no cost sample while a background compile shares the CPU (it would make this shape look slow)
            timed = int(took.max(initial=0)) if not (busy or self._compiling) else 0
            self.observe_cost(c, batch, time.perf_counter() - t, timed, sig)
            used[:, self.index(c)] += took
            if c is not None:
                acc += self.observe_acceptance((hist2 - hist)[:n, 1:], greedy, c.depth, c)
            vct, hist = vct2, hist2
        return state, used

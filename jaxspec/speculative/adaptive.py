"""Adaptive speculation: whether to speculate, chosen between blocks of rounds from what was measured.

Candidates: the configured tree shape, and no speculation (plain decoding steps that keep the draft
up to date, `loop.plain_steps`). Both are lossless, so the choice changes speed only. Before each
block of BLOCK_ROUNDS rounds (the offline engine, `Adaptive.run`) or each dispatch (the server,
which feeds `observe_cost` / `observe_acceptance` itself) the candidate with the most expected
tokens per second for the requests still running is run:

    value(shape) = sum over running requests of E[tokens per round | shape, request] / cost(shape, B)

cost: seconds per round of (shape, batch size B), the median over the last COST_SAMPLES blocks
that did not compile (a median, so that one slow block, e.g. a busy machine, does not decide).
E[tokens per round]: 1 without speculation; with it 1 + sum_j P(accepted >= j) over the depths j
of the tree, from the request's own rounds (the survival counts of its accept-length
histogram), with the rounds of earlier requests of the same kind (greedy or sampled) as a prior
worth PRIOR_ROUNDS rounds. Speculation stops only when plain steps are expected to be MARGIN
faster (estimates are noisy, and while speculation is off a request's acceptance is not observed).
Then the configured shape is tried again for one block after EXPLORE_MIN blocks, an interval that
doubles (up to EXPLORE_MAX) each time the trial confirms the choice.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxspec.config import SpecConfig

BLOCK_ROUNDS = 8
PRIOR_ROUNDS = 16.0  # a request's own rounds outweigh the prior once it has run more than this many
PRIOR_DECAY = 0.98  # per block: the prior follows the last few hundred rounds
COST_SAMPLES = 8  # a round's cost is the median of the last this many blocks' (once there are 2)
MARGIN = 0.05  # speculation stops only when plain steps are expected to be this much faster
EXPLORE_MIN, EXPLORE_MAX = 4, 64
OFF = "off"


def shape_label(spec: SpecConfig | None) -> str:
    """'num_steps/topk/num_draft_tokens', or 'off' (no speculation)."""
    return OFF if spec is None else f"{spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}"


@dataclasses.dataclass
class Adaptive:
    """The choice and what it is made from; one per engine, kept across generate calls."""

    spec: SpecConfig
    rounds: int = BLOCK_ROUNDS  # rounds (or plain steps) per block
    # (label, B) -> seconds per round of the last blocks
    cost: dict[tuple[str, int], list[float]] = dataclasses.field(default_factory=dict)
    compiled: set[tuple] = dataclasses.field(default_factory=set)  # program signatures run at least once
    # greedy / sampled -> [D + 1] survival counts of earlier requests' rounds (index 0: rounds)
    prior: dict[bool, np.ndarray] = dataclasses.field(default_factory=dict)
    explore_gap: int = EXPLORE_MIN
    since_explore: int = 0
    exploring: bool = False

    @property
    def candidates(self) -> list[SpecConfig | None]:
        return [self.spec, None]

    def expected_tokens(self, surv: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """surv [R, D + 1] per-request survival counts, greedy [R] bool -> E[tokens per round] of the
        configured shape [R]."""
        d = self.spec.num_steps
        start = np.array([1.0] + [0.5**j for j in range(1, d + 1)])  # before any round was seen
        p = np.stack([self.prior.get(bool(g), start) for g in greedy])  # [R, D + 1]
        p = p[:, 1:] / np.maximum(p[:, :1], 1e-9)
        frac = (surv[:, 1:] + PRIOR_ROUNDS * p) / (surv[:, :1] + PRIOR_ROUNDS)
        return 1.0 + frac.sum(-1)

    def choose(self, batch: int, surv: np.ndarray, greedy: np.ndarray, n_plain: int = 0) -> SpecConfig | None:
        """The candidate for the next block; surv: [R, D + 1] and greedy [R] of the running
        speculative requests; n_plain: running requests that never speculate (one token per round
        either way)."""
        if len(surv) == 0:
            return None
        for c in self.candidates:  # measure every candidate's cost first, the configured shape first
            if len(self.cost.get((shape_label(c), batch), [])) < 2:
                return c
        spec_rate = (self.expected_tokens(surv, greedy).sum() + n_plain) / self.round_cost(self.spec, batch)
        better = spec_rate * (1 + MARGIN) >= (len(surv) + n_plain) / self.round_cost(None, batch)
        if self.exploring and not better:  # the last block looked again and confirmed: look less often
            self.explore_gap = min(2 * self.explore_gap, EXPLORE_MAX)
        self.exploring = False
        if better:
            self.since_explore, self.explore_gap = 0, EXPLORE_MIN
            return self.spec
        self.since_explore += 1
        if self.since_explore > self.explore_gap:  # look again at the requests' acceptance
            self.since_explore, self.exploring = 0, True
            return self.spec
        return None

    def observe_cost(self, spec: SpecConfig | None, batch: int, seconds: float, rounds: int, sig: tuple) -> None:
        """A block of `rounds` rounds of `spec` at batch size `batch` took `seconds`. sig: the
        compiled program that ran it; its first run (compiling, setting up) is not a cost sample."""
        if sig in self.compiled and rounds > 0:
            key = (shape_label(spec), batch)
            self.cost[key] = [*self.cost.get(key, []), seconds / rounds][-COST_SAMPLES:]
        self.compiled.add(sig)

    def observe_acceptance(self, block_hist: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """block_hist [R, D + 1]: rounds of a speculative block that accepted 0 .. D drafts, per
        request; greedy [R]. Adds them to the prior of each kind; returns their survival counts
        [R, D + 1] (rounds that accepted >= j)."""
        block_surv = np.cumsum(block_hist[:, ::-1], axis=1)[:, ::-1].astype(np.float64)
        for g in (False, True):
            total = block_surv[greedy == g].sum(0)
            if total[0] > 0:
                self.prior[g] = total + PRIOR_DECAY * self.prior.get(g, np.zeros_like(total))
        return block_surv

    def round_cost(self, spec: SpecConfig | None, batch: int) -> float:
        return float(np.median(self.cost[(shape_label(spec), batch)]))

    def run(self, block: Callable[[SpecConfig | None, Any], Any], state, greedy: np.ndarray, signature: tuple):
        """Runs blocks on `state` (a SpecState of which rows [0, n) are requests; greedy [n] bool)
        until every request is done. block(spec, state) -> state runs one block. signature: what
        else the compiled programs depend on (batch, buffer and cache sizes, sampled). Returns
        (state, rounds [n, 2] that each request ran with each candidate)."""
        n = len(greedy)
        batch = int(state.last.shape[0])
        d = self.spec.num_steps
        used = np.zeros((n, 2), np.int64)
        surv = np.zeros((n, d + 1))
        vct, hist = (np.asarray(x) for x in jax.device_get((state.verify_ct, state.hist)))
        done = np.asarray(jax.device_get(state.done))
        while not done[:n].all():
            running = ~done[:n]
            c = self.choose(batch, surv[running], greedy[running])
            sig = (shape_label(c), *signature)
            t = time.perf_counter()
            state = block(c, state)
            done, vct2, hist2 = (np.asarray(x) for x in jax.device_get((state.done, state.verify_ct, state.hist)))
            took = (vct2 - vct)[:n]
            self.observe_cost(c, batch, time.perf_counter() - t, int(took.max(initial=0)), sig)
            used[:, 0 if c is not None else 1] += took
            if c is not None:
                surv += self.observe_acceptance((hist2 - hist)[:n, 1:], greedy)
            vct, hist = vct2, hist2
        return state, used

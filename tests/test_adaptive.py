"""Adaptive speculation: the choice between the tree shape and plain steps, and that every mix of
the two is lossless (greedy identical to plain decoding, sampling from the target distribution)
and keeps the draft in step with the target, in the offline engine and per server dispatch."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from jaxspec.config import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams
from jaxspec.speculative.adaptive import (
    EXPLORE_MAX,
    EXPLORE_MIN,
    OFF,
    OFFLINE_MARGIN,
    PRIOR_ROUNDS,
    SERVER_MARGIN,
    SERVER_PRIOR_ROUNDS,
    TRIAL_ROUNDS,
    Adaptive,
    shallower,
    shape_label,
)

from helpers import (  # noqa: F401 - models is a fixture
    GREEDY,
    PROMPTS,
    chi2_pvalue,
    engine,
    exact_pair_distribution,
    models,
    plain,
    sample_pairs,
)

SPEC = SpecConfig("EAGLE3", "x", 2, 1, 3, adaptive=True)


def test_an_explicit_tree_shape_turns_adaptive_speculation_off():
    """The shipped draft runs adaptively at its shipped shape; a tree shape the user sets is the
    shape run (as in SGLang), unless adaptive speculation is asked for as well."""
    from jaxspec.args import SpeculativeArgs

    bundled = ("EAGLE3", "/shipped/head", (2, 1, 3))
    resolve = lambda **kw: SpecConfig.resolve(SpeculativeArgs(**kw), bundled=bundled, warn=False)
    assert resolve().adaptive
    shape = dict(speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
    static = resolve(**shape)
    assert not static.adaptive and (static.num_steps, static.eagle_topk, static.num_draft_tokens) == (1, 1, 2)
    assert resolve(**shape, speculative_adaptive=True).adaptive
    assert not resolve(speculative_adaptive=False).adaptive


def _forced(eng, order, rounds=1):
    """Makes eng's adaptive choice follow `order` (cycled; indices into its candidates: 0 the
    configured shape, 1 the shallower one, -1 no speculation), in blocks of `rounds` rounds."""
    shapes = itertools.cycle(order)
    eng.adaptive.rounds = rounds
    eng.adaptive.choose = lambda batch, acc, greedy, n_plain=0, allowed=None: eng.adaptive.candidates[next(shapes)]
    eng.adaptive._compile_ahead = lambda precompile, signature: None  # forced choices compile as they come
    return eng


def test_candidates():
    a = Adaptive(SPEC)
    assert [shape_label(c) for c in a.candidates] == ["2/1/3", "1/1/2", OFF]
    assert a.candidates[0] is SPEC and a.index(None) == 2 and a.index(a.candidates[1]) == 1
    assert shallower(SpecConfig("EAGLE3", "x", 5, 4, 8)) == SpecConfig("EAGLE3", "x", 2, 4, 8)
    assert shallower(SpecConfig("EAGLE3", "x", 3, 2, 6)) == SpecConfig("EAGLE3", "x", 1, 2, 3)
    assert shallower(SpecConfig("EAGLE3", "x", 1, 1, 2)) is None
    assert [shape_label(c) for c in Adaptive(SpecConfig("EAGLE3", "x", 1, 1, 2)).candidates] == ["1/1/2", OFF]


def test_acceptance_counts_stop_at_the_depth_a_shape_reaches():
    a = Adaptive(SPEC)
    greedy = np.array([True])
    # a 1-step shape: 3 rounds accepted nothing, 2 their one draft; depth 2 was never reached
    np.testing.assert_array_equal(a.observe_acceptance(np.array([[3, 2, 0]]), greedy, 1), [[[5, 0], [2, 0]]])
    np.testing.assert_array_equal(a.observe_acceptance(np.array([[3, 2, 1]]), greedy, 2), [[[6, 3], [3, 1]]])
    np.testing.assert_array_equal(a.prior[True], [[6 + 0.98 * 5, 3], [3 + 0.98 * 2, 1]])


def test_choice_is_among_the_candidates_that_can_run():
    """A candidate with no compiled program is never chosen: it could never be measured (the
    configured shape would run in its place), and the choice would stay on it for good."""
    a = Adaptive(SPEC)
    one, none = np.array([True]), a.empty(1)
    a.cost[("2/1/3", 1, 0, False)] = [0.06, 0.06]
    assert a.choose(1, none, one, allowed=["2/1/3", OFF]) is None  # not the shallower shape: plain steps next
    a.cost[(OFF, 1, 0, False)] = [0.02, 0.02]
    low = np.array([[[100, 10], [10, 0]]], float)
    assert a.choose(1, low, one, allowed=["2/1/3", OFF]) is None
    assert a.choose(1, low, one, allowed=["2/1/3"]) is SPEC  # only the configured shape has a program
    assert a.choose(1, a.empty(0), one[:0], allowed=["2/1/3"]) is SPEC  # not even plain steps


def test_choice_follows_cost_and_acceptance():
    a = Adaptive(SPEC)
    half = a.candidates[1]
    one = np.array([True])
    none = a.empty(1)
    assert a.choose(1, none, one) is SPEC  # no cost measured yet: each candidate in turn
    a.cost[("2/1/3", 1, 0, False)] = [0.06, 0.05, 0.07]
    assert a.choose(1, none, one) is half
    a.cost[("1/1/2", 1, 0, False)] = [0.05, 0.045]
    assert a.choose(1, none, one) is None
    a.cost[(OFF, 1, 0, False)] = [0.035]
    assert a.choose(1, none, one) is None  # measured twice before it counts
    a.cost[(OFF, 1, 0, False)] = [0.035, 0.5, 0.03]  # one slow block does not decide
    acc = lambda tried, passed: np.array([[tried, passed]], float)
    # depth 1 accepted 10%: 1.16 / 0.0475 and 1.2 / 0.06 < 1 / 0.035
    low = acc([100, 10], [10, 0])
    picks = [a.choose(1, low, one) for _ in range(EXPLORE_MIN + 1)]
    assert picks[:EXPLORE_MIN] == [None] * EXPLORE_MIN and picks[-1] is SPEC  # then a look again
    assert a.choose(1, low, one) is None and a.explore_gap["2/1/3"] == 2 * EXPLORE_MIN  # confirmed: looks less often
    # both depths accepted often: 2.39 / 0.06 > 1.85 / 0.0475 > 1 / 0.035
    high = acc([100, 90], [90, 60])
    assert a.choose(1, high, one) is SPEC and a.explore_gap["2/1/3"] == EXPLORE_MIN
    # depth 1 often, depth 2 rarely: the shallower shape, 1.6 / 0.0475 > 1.66 / 0.06, 1 / 0.035
    mid = acc([1000, 600], [600, 60])
    assert a.choose(1, mid, one) is half
    # the server's margin: 1.6 / 0.0544 is 3% above 1 / 0.035, not the 5% speculation must gain
    a.margin = SERVER_MARGIN
    a.cost[("1/1/2", 1, 0, False)] = [0.0544, 0.0544]
    a.since_explore["2/1/3"] = -100  # (no trial of the configured shape in between)
    assert a.choose(1, mid, one) is None
    a.cost[("1/1/2", 1, 0, False)] = [0.0515, 0.0515]  # 9% above: speculation
    assert a.choose(1, mid, one) is half
    # the offline engine's: speculation stops only where plain steps lead by 5%
    a.margin = OFFLINE_MARGIN
    a.cost[("2/1/3", 1, 0, False)] = [0.066, 0.066]  # 1.66 / 0.066: below the shallower shape from here on
    for cost, pick in [(0.0544, half), (0.058, half), (0.0625, None)]:  # plain steps 3% behind, 3% and 11% ahead
        a.cost[("1/1/2", 1, 0, False)] = [cost, cost]
        a.since_explore["2/1/3"] = -100
        assert a.choose(1, mid, one) is pick, cost
    assert Adaptive(SPEC).margin == OFFLINE_MARGIN
    a.margin = SERVER_MARGIN
    # requests that never speculate add one token per round to every candidate
    assert a.choose(1, low, one, n_plain=3) is None
    # the prior of the request's kind, worth PRIOR_ROUNDS rounds, per depth
    a.prior = {True: np.array([[10.0, 5.0], [5.0, 2.0]]), False: np.array([[10.0, 0.0], [1.0, 0.0]])}
    w = PRIOR_ROUNDS
    c1, c2 = (90 + w * 0.5) / (100 + w), (60 + w * 0.4) / (90 + w)
    assert a.expected_tokens(high, one)[0] == pytest.approx(1 + c1 + c1 * c2)
    assert a.expected_tokens(high, one, half)[0] == pytest.approx(1 + c1)
    # no prior at a depth (only shallower rounds seen): one half, as before any round
    np.testing.assert_allclose(a.expected_tokens(a.empty(2), np.array([True, False])), [1.7, 1.1 + 0.1 * 0.5])
    assert shape_label(SPEC) == "2/1/3" and shape_label(None) == OFF


def test_a_trial_outweighs_costs_measured_while_the_machine_ran_slower():
    """A candidate not chosen is measured only by the configured shape's trials, while the one
    chosen is measured every block. Costs taken during a slow start (a server's first requests ran
    the tree at twice its later cost) must not keep plain steps chosen for many trials: each sample
    weighs half as much per COST_HALF_LIFE seconds older than the shape's newest."""
    from jaxspec.speculative.adaptive import COST_HALF_LIFE

    a = Adaptive(SPEC, margin=SERVER_MARGIN)
    one = np.array([True])
    acc = np.array([[[200, 120], [120, 60]]], float)  # 1.89 tokens a round expected at 2/1/3
    sig = ("sig",)
    a.compiled.add(sig)
    for t in range(6):  # the start: the tree at 48 ms a round, plain steps at 27
        a.observe_cost(SPEC, 1, 0.096, 2, sig, at=t * 0.1)
        a.observe_cost(None, 1, 0.162, 6, sig, at=t * 0.1 + 0.05)
    a.observe_cost(a.candidates[1], 1, 0.2, 2, sig, at=0.7)
    a.observe_cost(a.candidates[1], 1, 0.2, 2, sig, at=0.8)
    for t in range(8):  # later, settled: plain steps measured again each dispatch at 22 ms
        a.observe_cost(None, 1, 0.132, 6, sig, at=10 + t * 0.1)
    assert a.round_cost(None, 1) == pytest.approx(0.022)
    assert a.choose(1, acc, one) is None  # 1.89 / 0.048 < 1.05 / 0.022
    # one trial of the tree, 3 half-lives after its samples, at 24 ms a round: that is its cost now
    a.observe_cost(SPEC, 1, 0.048, 2, sig, at=0.5 + 3 * COST_HALF_LIFE + 1)
    assert a.round_cost(SPEC, 1) == pytest.approx(0.024)
    assert a.choose(1, acc, one) is SPEC
    # samples of the same moment weigh alike: the median, one slow block among them does not decide
    a.cost_at[("2/1/3", 1, 0, False)] = [5.0] * 3
    a.cost[("2/1/3", 1, 0, False)] = [0.024, 0.5, 0.026]
    assert a.round_cost(SPEC, 1) == pytest.approx(0.026)
    a.cost_at[("2/1/3", 1, 0, False)] = [5.0] * 4
    a.cost[("2/1/3", 1, 0, False)] = [0.024, 0.5, 0.026, 0.02]
    assert a.round_cost(SPEC, 1) == pytest.approx(0.025)  # an even count: between the middle two


def test_a_trial_runs_several_short_blocks():
    """The server's dispatches run a few rounds each: a trial of the configured shape lasts
    TRIAL_ROUNDS rounds, so that it measures the shape's cost more than once and its acceptance over
    more than a round or two, before the choice is made again."""
    a = Adaptive(SPEC, margin=SERVER_MARGIN, rounds=2)
    one = np.array([True])
    a.cost[("2/1/3", 1, 0, False)] = [0.06, 0.06]
    a.cost[("1/1/2", 1, 0, False)] = [0.05, 0.05]
    a.cost[(OFF, 1, 0, False)] = [0.02, 0.02]
    low = np.array([[[100, 10], [10, 0]]], float)
    trial = TRIAL_ROUNDS // 2
    picks = [a.choose(1, low, one) for _ in range(EXPLORE_MIN + trial + 1)]
    assert picks == [None] * EXPLORE_MIN + [SPEC] * trial + [None]
    assert a.explore_gap["2/1/3"] == 2 * EXPLORE_MIN  # confirmed: looks less often
    assert Adaptive(SPEC).rounds >= TRIAL_ROUNDS  # offline, a block is a whole trial


def test_the_server_tries_plain_steps_again_while_the_tree_runs():
    """The server's costs are measured beside changing load, so a candidate measured once while it
    ran slow must not stay unchosen: with `retry_all` (the server) plain steps get trials while the
    tree runs, as the configured shape does while they run. A trial that finds them faster now
    switches; one that confirms the tree makes the next trial come later. Offline, only the
    configured shape has trials."""
    sig = ("sig",)
    acc = np.array([[[200, 120], [120, 60]]], float)  # 1.89 tokens a round expected at 2/1/3
    one = np.array([True])
    trial = TRIAL_ROUNDS // 2

    def start(**kw):
        a = Adaptive(SPEC, margin=SERVER_MARGIN, rounds=2, **kw)
        a.compiled.add(sig)
        for t in range(4):  # plain steps measured while the machine ran slow: 40 ms a round
            a.observe_cost(None, 1, 0.08, 2, sig, at=t * 0.1)
            a.observe_cost(a.candidates[1], 1, 0.2, 2, sig, at=t * 0.1)
        for t in range(4):  # the tree at 40 ms a round: 1.89 / 0.04 > 1.05 / 0.04
            a.observe_cost(SPEC, 1, 0.08, 2, sig, at=1 + t * 0.1)
        return a

    a = start(retry_all=True)
    picks = [shape_label(a.choose(1, acc, one)) for _ in range(EXPLORE_MIN + 2 * trial)]
    # the shallower shape first (the candidates' order), then plain steps, due as well
    assert picks == ["2/1/3"] * EXPLORE_MIN + ["1/1/2"] * trial + [OFF] * trial
    for t in range(trial):  # the trial finds them at 15 ms a round now: 1 / 0.015 > 1.89 / 0.04 x 1.05
        a.observe_cost(None, 1, 0.03, 2, sig, at=30 + t * 0.1)
    assert a.choose(1, acc, one) is None
    assert a.explore_gap[OFF] == EXPLORE_MIN and a.explore_gap["1/1/2"] == 2 * EXPLORE_MIN

    b = start(retry_all=True)
    for t in range(40):  # trials that keep confirming the tree come ever later
        b.observe_cost(None, 1, 0.08, 2, sig, at=2 + t)
        b.choose(1, acc, one)
    assert b.explore_gap[OFF] > EXPLORE_MIN

    c = start()  # offline: plain steps measured once stay
    assert {shape_label(c.choose(1, acc, one)) for _ in range(3 * EXPLORE_MAX)} == {"2/1/3"}


def test_a_trial_starting_leaves_the_chosen_candidate_s_count_at_zero():
    """The choice that starts a trial of an earlier candidate (here the configured tree, while the
    shallower shape is chosen) counts blocks for the candidates not chosen only: the chosen one,
    later in the candidates' order, stays at zero blocks since it ran."""
    sig = ("sig",)
    acc = np.array([[[200, 120], [120, 60]]], float)
    one = np.array([True])
    a = Adaptive(SPEC, margin=SERVER_MARGIN, rounds=2, retry_all=True)
    a.compiled.add(sig)
    for t in range(4):  # 1/1/2 at 20 ms a round, the tree and plain steps at 40
        a.observe_cost(None, 1, 0.08, 2, sig, at=t * 0.1)
        a.observe_cost(a.candidates[1], 1, 0.04, 2, sig, at=t * 0.1)
        a.observe_cost(SPEC, 1, 0.08, 2, sig, at=t * 0.1)
    picks = [shape_label(a.choose(1, acc, one)) for _ in range(EXPLORE_MIN + 1)]
    assert picks == ["1/1/2"] * EXPLORE_MIN + ["2/1/3"]  # the tree's trial is due first
    assert a.trial == "2/1/3" and a.since_explore["1/1/2"] == 0


def test_the_server_weighs_the_prior_more_than_a_request_s_first_rounds():
    """A request whose first rounds accepted less than earlier requests did: offline its own rounds
    soon outweigh the prior and plain steps run; the server (SERVER_PRIOR_ROUNDS) keeps the tree,
    since plain steps would teach its estimate nothing and a dip held it on them."""
    one = np.array([True])
    dip = np.array([[[24, 6], [6, 1]]], float)  # 24 rounds: depth 1 accepted 6 times, depth 2 once
    picks = {}
    for w in (PRIOR_ROUNDS, SERVER_PRIOR_ROUNDS):
        a = Adaptive(SPEC, margin=SERVER_MARGIN, prior_rounds=w)
        a.prior = {True: np.array([[1000.0, 620.0], [620.0, 260.0]])}  # 1.88 tokens a round before
        a.cost = {("2/1/3", 1, 0, False): [0.0217] * 2, (OFF, 1, 0, False): [0.0142] * 2}
        # break-even: 1.05 x 21.7 / 14.2 = 1.60 tokens a round
        picks[w] = (a.expected_tokens(dip, one)[0], a.choose(1, dip, one, allowed=["2/1/3", OFF]))
    assert picks[PRIOR_ROUNDS][0] == pytest.approx(1.537, abs=1e-3) and picks[PRIOR_ROUNDS][1] is None
    assert picks[SERVER_PRIOR_ROUNDS][0] == pytest.approx(1.725, abs=1e-3) and picks[SERVER_PRIOR_ROUNDS][1] is SPEC


def test_costs_at_unmeasured_batch_sizes_are_interpolated():
    """A batch size measured twice uses its own median; another is interpolated between the nearest
    measured ones (the nearest one beyond them), so a new batch size needs no measuring first."""
    a = Adaptive(SPEC)
    one, none = np.array([True]), a.empty(1)
    a.cost[("2/1/3", 2, 0, False)] = [0.02, 0.02]
    a.cost[("2/1/3", 6, 0, False)] = [0.06, 0.06, 0.07]
    a.cost[("2/1/3", 4, 0, False)] = [0.5]  # one sample: not yet its own
    assert a.round_cost(SPEC, 2) == 0.02 and a.round_cost(SPEC, 4) == pytest.approx(0.04)
    assert a.round_cost(SPEC, 1) == 0.02 and a.round_cost(SPEC, 8) == 0.06
    assert a.choose(5, none, one) is a.candidates[1]  # the shallower shape was never measured anywhere
    a.cost[("1/1/2", 2, 0, False)] = [0.015, 0.015]
    a.cost[(OFF, 2, 0, False)] = [0.01, 0.01]
    low = np.array([[[100, 10], [10, 0]]], float)
    assert a.choose(5, low, one) is None  # decided at batch 5 from batch 2's costs alone


def test_costs_are_those_of_the_program_each_candidate_would_run():
    """A server call runs through the cheapest compiled program that covers it: costs are kept per
    (batch size, span, sampling or greedy) of that program, and each candidate is costed where it
    would run. A span never measured takes the nearest one's costs, of the same kind first."""
    a = Adaptive(SPEC)
    one = np.array([True])
    low = np.array([[[100, 10], [10, 0]]], float)  # E[tokens] 1.1 per round of the tree
    a.cost[("2/1/3", 8, 256, False)] = [0.10, 0.10]
    a.cost[("1/1/2", 8, 256, False)] = [0.09, 0.09]
    a.cost[(OFF, 8, 256, False)] = [0.04, 0.04]
    a.cost[(OFF, 16, 1024, False)] = [0.12, 0.12]
    assert a.round_cost(None, 8, 256) == 0.04 and a.round_cost(None, 16, 1024) == 0.12
    assert a.round_cost(None, 8, 512) == 0.12  # 256 and 1024 equally near on a log scale: the larger
    a.cost[(OFF, 16, 512, False)] = [0.08, 0.08]
    assert a.round_cost(None, 8, 512) == 0.08  # the nearest span measured, its nearest batch size
    assert a.round_cost(SPEC, 4, 128) == a.round_cost(SPEC, 8, 128) == 0.10
    # a sampling program is a kind of its own: its costs first, whatever their span
    a.cost[("2/1/3", 8, 128, True)] = [0.2, 0.2]
    assert a.round_cost(SPEC, 8, 256, True) == 0.2 and a.round_cost(SPEC, 8, 256) == 0.10
    # plain steps only through the large program: 1 token / 0.12 s loses to 1.1 / 0.10 s
    assert a.choose(8, low, one, allowed={"2/1/3": (8, 256, False), OFF: (16, 1024, False)}) is SPEC
    # through the exact one: 1 / 0.04 s wins
    assert a.choose(8, low, one, allowed={"2/1/3": (8, 256, False), OFF: (8, 256, False)}) is None


def test_server_costs_a_greedy_call_of_a_sampling_program_as_greedy(monkeypatch):
    """On CPU a sampling program skips its sampler for a call with no drawing slot, so the
    server keeps that dispatch's cost with the greedy ones; where programs are straight-line (GPU)
    it is a sampling cost whoever calls."""
    from jaxspec import sampling
    from jaxspec.server.dispatch import cost_kind

    sampling_prog, greedy_prog = (
        ("dispatch", 4, 256, True, OFF, False, False),
        ("dispatch", 4, 256, False, OFF, False, False),
    )
    monkeypatch.setattr(sampling, "SKIP_UNUSED", True)
    assert cost_kind(sampling_prog, False) is False and cost_kind(sampling_prog, True) is True
    assert cost_kind(greedy_prog, False) is False
    monkeypatch.setattr(sampling, "SKIP_UNUSED", False)
    assert cost_kind(sampling_prog, False) is True and cost_kind(greedy_prog, False) is False


def test_no_greedy_only_programs_where_sampling_ones_skip_their_sampler(models, monkeypatch):  # noqa: F811
    """On CPU no greedy-only dispatch program is compiled ahead, in the background or for a call no
    program covers (a sampling one serves a greedy call as fast), which leaves the memory-map
    budget to other shapes; straight-line sampling programs (GPU) get their greedy twins."""
    import jax

    from jaxspec import sampling
    from jaxspec.server.scheduler import Scheduler

    sched = Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), max_running_requests=2)
    kinds = lambda: {k[3] for k in sched.programs.background_keys() if k[0] == "dispatch"}
    monkeypatch.setattr(sampling, "SKIP_UNUSED", None)  # the default: skips on CPU only
    assert sampling.skips_unused() == (jax.default_backend() == "cpu")
    sched.programs.lazy = False  # none compiled yet: the key a greedy call would compile now
    monkeypatch.setattr(sampling, "SKIP_UNUSED", True)
    assert kinds() == {True}
    assert sched.programs.dispatch_key(1, 64, False)[3] is True
    monkeypatch.setattr(sampling, "SKIP_UNUSED", False)
    assert kinds() == {True, False}
    assert sched.programs.dispatch_key(1, 64, False)[3] is False


@pytest.mark.parametrize(
    "algo,draft,knobs,target",
    [
        pytest.param("STANDALONE", "target", (4, 1, 5), "target", marks=pytest.mark.slow),
        ("EAGLE3", "eagle3", (3, 2, 6), "target"),
    ],
)
def test_alternating_blocks_are_lossless(models, algo, draft, knobs, target):  # noqa: F811
    """Blocks cycle through the tree, plain steps and the shallower tree: greedy output equals plain
    decoding, and with the target as its own draft every round after a plain block still accepts
    every draft token (the plain steps kept the draft's cache in step)."""
    # the target as its own draft runs unquantized, i.e. is the target (on CPU a draft runs in int8 by default)
    quant = dict(speculative_draft_model_quantization="unquant") if draft == "target" else {}
    eng = _forced(engine(models, algo, draft, knobs, target=target, speculative_adaptive=True, **quant), [0, -1, 1])
    sp = dict(GREEDY, max_new_tokens=60)
    ref = engine(models).generate(input_ids=PROMPTS, sampling_params=sp)
    out = eng.generate(input_ids=PROMPTS, sampling_params=sp)
    steps = knobs[0]
    for r, want in zip(out, ref):
        m = r["meta_info"]
        assert r["output_ids"] == want["output_ids"]
        assert all(m["spec_shapes"][shape_label(c)] > 0 for c in eng.adaptive.candidates)
        # plain steps apart: spec_verify_ct, the accept length and the histogram count rounds only
        assert m["spec_plain_steps"] == m["spec_shapes"][OFF]
        assert sum(m["spec_shapes"].values()) == m["spec_verify_ct"] + m["spec_plain_steps"]
        assert sum(m["spec_accept_histogram"]) == m["spec_verify_ct"]
        spec_tokens = m["completion_tokens"] - m["spec_plain_steps"]
        assert m["spec_accept_length"] == pytest.approx(spec_tokens / m["spec_verify_ct"])
        if draft == "target":  # every round accepts its every draft: all steps, or the shallower tree's
            half = eng.adaptive.candidates[1].num_steps
            hist = m["spec_accept_histogram"]
            assert [i for i, x in enumerate(hist) if x and i] == [half, steps], hist


def test_offline_candidates_compile_ahead_and_switching_compiles_nothing(models):  # noqa: F811
    """The offline engine compiles the shallower shape and the plain steps in the background while
    the configured shape runs the first request (once it is timed); afterwards blocks of every
    candidate run with no compile, losslessly."""
    import jax

    eng = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True)
    sp = dict(GREEDY, max_new_tokens=120)  # blocks of 8 rounds: the compiles start after the third
    want = [r["output_ids"] for r in engine(models).generate(input_ids=PROMPTS[:1], sampling_params=sp)]
    assert [r["output_ids"] for r in eng.generate(input_ids=PROMPTS[:1], sampling_params=sp)] == want
    for thread in list(eng.adaptive._compiling.values()):
        thread.join()
    assert {k[0] for k in eng.adaptive.ready} == {shape_label(c) for c in eng.adaptive.candidates}
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    _forced(eng, [1, -1, 0], rounds=eng.adaptive.rounds)  # the same programs: blocks of as many rounds
    out = eng.generate(input_ids=PROMPTS[:1], sampling_params=sp)
    assert [r["output_ids"] for r in out] == want
    assert all(v > 0 for v in out[0]["meta_info"]["spec_shapes"].values())
    assert compiles == []


@pytest.mark.slow
@pytest.mark.parametrize("order", [[-1], [-1, 0], [0, -1, 1]], ids=["off", "off-tree", "tree-off-shallower"])
def test_plain_blocks_sample_the_target_distribution(models, order):  # noqa: F811
    """(t1, t2) of sampled requests follow the target distribution with speculation off or
    alternating round by round (chi-square), and another temperature's distribution is rejected (power)."""
    eng = _forced(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), order)
    counts = sample_pairs(eng, PROMPTS[0], 3000, 1.0)
    assert chi2_pvalue(counts, exact_pair_distribution(models["hf"], PROMPTS[0], 1.0)) > 1e-3
    assert chi2_pvalue(counts, exact_pair_distribution(models["hf"], PROMPTS[0], 0.6)) < 1e-6


def test_flags(models):  # noqa: F811
    assert engine(models, "EAGLE3", "eagle3", (3, 2, 6)).adaptive is None  # a draft of your own: off unless asked
    from jaxspec.engine import Engine

    with pytest.raises(JaxspecError, match="NGRAM"):
        Engine(models["target"], skip_tokenizer_init=True, speculative_algorithm="NGRAM", speculative_adaptive=True)


def _serve(eng, prompts, params, order, slots=2, **kw):
    """Runs `prompts` through a Scheduler whose adaptive choice per dispatch follows `order` (as
    _forced). Returns (results, scheduler)."""
    from jaxspec.server.scheduler import Request, Scheduler

    sched = Scheduler(eng, max_running_requests=slots, **kw)
    shapes = itertools.cycle(order)
    sched.adaptive.choose = lambda batch, acc, greedy, n_plain=0, allowed=None: sched.adaptive.candidates[next(shapes)]
    res = {}
    for i, p in enumerate(prompts):
        emit = lambda e, i=i: res.__setitem__(i, e["result"]) if e["type"] == "done" else None
        sched.submit(Request(ids=p, params=SamplingParams.from_dict(params[i]), emit=emit))
    sched.run_until_idle()
    return [res[i] for i in range(len(prompts))], sched


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_server_dispatches_alternate_losslessly(models, overlap):  # noqa: F811
    """Server dispatches cycle through the tree shape, plain steps and the shallower tree: greedy
    outputs equal the plain engine's, requests with a repetition penalty (which never speculate)
    keep their penalty in plain-step dispatches, and meta_info / Stats count the rounds of each."""
    pen = dict(GREEDY, repetition_penalty=1.5, frequency_penalty=0.5)
    params = [GREEDY, pen, GREEDY, pen]
    ref = [r["output_ids"] for r in engine(models).generate(input_ids=PROMPTS, sampling_params=params)]
    eng = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True)
    out, sched = _serve(eng, PROMPTS, params, [0, -1, -1, 1], overlap=overlap)
    labels = [shape_label(c) for c in sched.adaptive.candidates]
    for i, (r, want) in enumerate(zip(out, ref)):
        m = r["meta_info"]
        assert r["output_ids"] == want, i
        if i % 2 == 0:
            assert all(m["spec_shapes"][x] > 0 for x in labels), m["spec_shapes"]
            assert sum(m["spec_shapes"].values()) == m["spec_verify_ct"] + m["spec_plain_steps"]
        else:
            assert not m["speculative"] and "spec_shapes" not in m
    st = sched.stats
    assert all(st.shape_dispatches[x] > 0 for x in labels)
    assert st.shape_rounds[OFF] >= st.shape_dispatches[OFF]
    spec = [out[i]["meta_info"] for i in (0, 2)]  # Stats count speculative rounds and plain steps apart
    assert st.spec_plain_steps == sum(m["spec_plain_steps"] for m in spec) > 0
    assert st.spec_verify_ct == sum(m["spec_verify_ct"] for m in spec)
    assert sched.plain_step_share == pytest.approx(st.spec_plain_steps / (st.spec_plain_steps + st.spec_verify_ct))


@pytest.mark.slow
def test_server_measures_costs_and_acceptance(models, plain):  # noqa: F811
    """A real (unforced) adaptive scheduler measures rounds of each candidate (at some batch size),
    collects each speculative request's acceptance (the target as its own draft accepts every
    draft token), and then runs mostly the candidate that its own measurements favour."""
    from jaxspec.server.scheduler import Request, Scheduler

    eng = engine(
        models,
        "STANDALONE",
        "target",
        (4, 1, 5),
        speculative_adaptive=True,
        speculative_draft_model_quantization="unquant",
    )
    sched = Scheduler(eng, max_running_requests=2, overlap=False)
    a, picks, choose = sched.adaptive, [], sched.adaptive.choose
    assert a.margin == SERVER_MARGIN and a.prior_rounds == SERVER_PRIOR_ROUNDS and a.retry_all

    def favoured(batch, acc, greedy, n_plain=0, allowed=None):
        """The candidate the measurements so far favour (the costs of sub-millisecond rounds move
        from one dispatch to the next, so this is judged when each choice is made), each costed at
        the program it would run with."""
        rate = {}
        for c in a.candidates:
            tokens = len(acc) if c is None else a.expected_tokens(acc, greedy, c).sum()
            where = allowed.get(shape_label(c), (batch, 0, False)) if isinstance(allowed, dict) else (batch, 0, False)
            rate[shape_label(c)] = (tokens + n_plain) / a.round_cost(c, *where)
        best = max(list(rate)[:-1], key=rate.get)  # the tree shapes' best, if it beats plain steps by the margin
        return best if rate[best] > rate[OFF] * (1 + SERVER_MARGIN) else OFF

    def spy(*args, **kw):  # (choice, the favoured candidate when every cost was known, else None)
        known = all(a._measured(c) for c in a.candidates)
        best = favoured(*args, **kw) if known and len(args[1]) else None
        picks.append((choose(*args, **kw), best))
        return picks[-1][0]

    a.choose = spy
    res = {}
    for i, p in enumerate(PROMPTS[:2]):
        emit = lambda e, i=i: res.__setitem__(i, e["result"]) if e["type"] == "done" else None
        sched.submit(Request(ids=p, params=SamplingParams.from_dict(dict(GREEDY, max_new_tokens=120)), emit=emit))
    sched.run_until_idle()
    label = shape_label(eng.spec)
    assert all(a._measured(c) for c in a.candidates)
    np.testing.assert_array_equal(a.prior[True][0], a.prior[True][1])  # every depth reached was accepted
    later = [(c, best) for c, best in picks if best is not None]  # mostly the favoured one (the rest: looking again)
    assert later and sum(shape_label(c) == best for c, best in later) > len(later) / 2, (a.cost, picks)
    for i, r in res.items():
        assert r["output_ids"][:24] == plain[len(PROMPTS[i])]
        shapes = r["meta_info"]["spec_shapes"]
        assert shapes[label] > 0 and sum(shapes.values()) == r["meta_info"]["spec_verify_ct"] + shapes[OFF]


@pytest.mark.slow
def test_server_candidate_programs_compile_in_the_background(models):  # noqa: F811
    """Start-up compiles plain steps for all the slots at short spans (where a busy server turns
    speculation off); the other twins of the start-up dispatches for the other candidates (plain
    steps, the shallower tree) are background programs, and a call runs another candidate only
    once a program of it is compiled (until then the configured shape serves it)."""
    from jaxspec.server.scheduler import Scheduler

    eng = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True)
    sched = Scheduler(eng, max_running_requests=2)
    progs = sched.programs
    progs.lazy = False
    startup = progs.startup_keys(2)
    bg = progs.background_keys()
    assert list(sched.shapes) == ["3/2/6", "1/2/3", OFF] and sched.main_shape == "3/2/6"
    assert all(k[4] == "3/2/6" for k in startup if k[0] == "dispatch" and k[4] != OFF)
    off = {("dispatch", 2, x, True, OFF, False, False) for x in progs.spans() if x <= 1024}
    assert off and {k for k in startup if k[0] == "dispatch" and k[4] == OFF} == off
    for x in (OFF, "1/2/3"):
        twins = {k[:4] + (x, False, False) for k in startup if k[0] == "dispatch" and not k[5]}
        assert twins <= set(bg) | off
    assert progs.dispatch_key(1, 64, False, OFF) is None
    progs.compile(("dispatch", 2, 128, True, OFF, False, False))
    assert progs.dispatch_key(1, 64, False, OFF) == ("dispatch", 2, 128, True, OFF, False, False)
    assert progs.dispatch_key(1, 64, False, "1/2/3") is None
    assert progs.dispatch_key(1, 64, False)[4] == "3/2/6"
    assert Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6)), max_running_requests=2).adaptive is None


@pytest.mark.slow
def test_server_dispatch_programs_have_no_vocab_sort_and_no_branch(models, monkeypatch):  # noqa: F811
    """Every kind of sampled server dispatch (tree rounds of either shape, plain steps), traced as
    for a GPU, compiles to straight-line bodies: no sort over the vocabulary, no conditional."""
    from test_sampling import assert_no_vocab_sort_or_branch

    from jaxspec.server.scheduler import Scheduler

    from helpers import V, straight_line_sampler

    straight_line_sampler(monkeypatch)

    sched = Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), max_running_requests=2)
    for shape in sched.shapes:
        hlo = sched.programs._lower(("dispatch", 2, 64, True, shape, False, False)).compile().as_text()
        assert_no_vocab_sort_or_branch(hlo, V)
    # with logprobs: a top-k of the whole (16-token) vocabulary is a sort here; over a real vocabulary
    # it is XLA's TopK (tests/test_logprobs.py), and still no branch
    hlo = sched.programs._lower(("dispatch", 2, 64, True, sched.main_shape, True, False)).compile().as_text()
    assert_no_vocab_sort_or_branch(hlo, V + 1)


def test_background_compiles_stop_within_the_memory_map_budget(models, monkeypatch, caplog):  # noqa: F811
    """Each XLA:CPU program holds hundreds of memory maps and the kernel's limit is fixed: once the
    process is past MAP_BUDGET of it, the background compile stops (with a warning) instead of
    compiling until a compile fails and aborts the server."""
    import jaxspec.server.programs as programs_module
    from jaxspec.server.scheduler import Scheduler

    sched = Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), max_running_requests=2)
    progs = sched.programs
    progs.lazy = False
    keys = progs.background_keys()
    assert keys[0][0] == "dispatch" and keys[0][4] == OFF  # adaptive's plain steps first
    used = iter([100, 100, 60_000])
    monkeypatch.setattr(programs_module, "map_usage", lambda: (next(used), 65_530))
    monkeypatch.setattr(progs, "compile", lambda key: None)
    monkeypatch.setattr(progs, "idle_only", False)
    with caplog.at_level("WARNING", logger="jaxspec.server"):
        progs.start_background()
        progs._thread.join(30)
    assert progs.background_done == progs.background_total == 2
    assert "background compiles stopped after 2 programs" in caplog.text


def test_background_compiles_stop_within_the_program_memory_budget(models, monkeypatch, caplog):  # noqa: F811
    """Compiled programs take tens of MB of host memory each (measured at start-up): the background
    list stops, with a warning, once one more program would pass their budget; the programs calls
    ask for (`want`) are still compiled, up to WANTED_MEMORY times the budget, and then nothing
    more, for good (a second warning)."""
    from jaxspec.server.memory import WANTED_MEMORY
    from jaxspec.server.scheduler import Scheduler

    sched = Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), max_running_requests=2)
    progs = sched.programs
    progs.lazy = False
    assert WANTED_MEMORY == 2
    progs.memory.budget_bytes, progs.memory.per_program, progs.memory.startup = 350 << 20, 100 << 20, 1
    done: list[tuple] = []
    monkeypatch.setattr(progs, "compile", done.append)
    monkeypatch.setattr(progs, "idle_only", False)
    with caplog.at_level("WARNING", logger="jaxspec.server"):
        progs.start_background()
        for _ in range(300):
            if "stopped after 2 programs" in caplog.text:
                break
            time.sleep(0.01)
        assert progs._thread.is_alive() and len(done) == 2  # the list stopped: 3 programs of 100 MB in 350
        assert "about 0.29 GiB of their 0.34 GiB budget" in caplog.text
        wanted = [("dispatch", 2, 64 * (i + 1), True, OFF, False, False) for i in range(6)]
        for key in wanted:
            progs.want(key)
        progs._thread.join(30)
    assert not progs._thread.is_alive()
    # 700 MB hold 7 programs: 4 of the wanted ones; the others are left to larger programs
    assert done[2:] == wanted[:4] and progs.memory.count == 7
    assert progs.background_done == progs.background_total == 6
    assert "stopped for good after 6 programs, 2 left" in caplog.text
    progs.want(("dispatch", 1, 64, True, OFF, False, False))  # stopped for good: nothing more is asked
    assert progs.background_total == 6 and not progs.wanted


def test_a_wanted_program_compiles_under_steady_load(models, monkeypatch):  # noqa: F811
    """On a CPU the background compiles wait for a quiet moment, which steady load never gives: a
    program a call wants is compiled once it has waited WANTED_WAIT; the list's keys still wait."""
    import jaxspec.server.programs as programs_module
    from jaxspec.server.scheduler import Scheduler

    sched = Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), max_running_requests=2)
    progs = sched.programs
    progs.lazy = False
    monkeypatch.setattr(programs_module, "WANTED_WAIT", 0.2)
    done: list[tuple] = []
    monkeypatch.setattr(progs, "compile", done.append)
    monkeypatch.setattr(sched, "idle_for", lambda seconds: False)  # requests all the time
    monkeypatch.setattr(progs, "idle_only", True)
    key = ("dispatch", 2, 128, True, OFF, False, False)
    progs.start_background()
    try:
        t = time.perf_counter()
        progs.want(key)
        for _ in range(300):
            if done:
                break
            time.sleep(0.01)
        assert done == [key] and time.perf_counter() - t >= 0.2
        time.sleep(0.3)
        assert done == [key]  # the list waits for a quiet moment
    finally:
        progs.stop()
        progs._thread.join(5)


def test_program_spans_and_the_constrained_cover(models):  # noqa: F811
    """Spans are powers of two up to max_len, which replaces the power of two just below it (a
    context of 2^k reads 2^k + scratch columns: one set of programs for both); every call's span
    is one of them; the start-up set serves constrained requests (with logprobs or not) at short
    spans and at every other."""
    from jaxspec.server.scheduler import Scheduler

    eng = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True)
    sched = Scheduler(eng, max_running_requests=2)
    progs = sched.programs
    assert sched.max_len == 256 + 64 and progs.spans() == [64, 320]
    assert [sched._span(x) for x in (1, 64, 65, 129, 256, 300)] == [64, 64, 320, 320, 320, 320]
    startup = progs.startup_keys(2)
    progs.lazy = False
    for key in startup:
        progs._table()[key] = object()  # as if compiled
    for n, span, lps in ((1, 64, False), (2, 100, True), (2, 300, False)):
        key = progs.dispatch_key(n, sched._span(span), True, logprobs=lps, grammar=True)
        assert key in startup and key[6] and key[2] >= span, key


def test_short_prompts_have_their_own_prefill_chunk_from_start_up(models):  # noqa: F811
    """At the short spans (chat prompts) the start-up set holds each prompt length's own chunk, and
    with prefix caching a cached prompt's tail's (the smallest), so that no prompt is prefilled
    through a span's largest chunk while its own waits for background compiles that may have
    stopped for good."""
    from jaxspec.engine import Engine
    from jaxspec.server.scheduler import Scheduler

    eng = Engine(models["target"], skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=256)
    sched = Scheduler(eng, max_running_requests=1)
    progs = sched.programs
    progs.lazy = False
    assert progs.chunk_sizes() == [64, 128, 256] and progs.spans()[:2] == [64, 256]
    for key in progs.startup_keys(1):
        progs._table()[key] = object()  # as if compiled
    for length, start in ((1, 0), (64, 0), (65, 0), (100, 0), (129, 0), (250, 0), (200, 190)):
        plan = progs.prefill_plan(1, length, start=start)
        assert plan == progs.prefill_plan(1, length, exact=True, start=start), (length, start, plan)
    # without prefix caching no prompt has a cached tail: the smallest chunk only at its own span
    uncached = Scheduler(eng, max_running_requests=1, prefix_cache=False).programs.startup_keys(1)
    assert ("chunk", 1, 128, 256) in uncached and ("chunk", 1, 64, 256) not in uncached


def test_programs_calls_want_compile_first_and_past_the_list_budget(models, monkeypatch, caplog):  # noqa: F811
    """A call served through a larger program asks for its own (`want`): the background compiles it
    before its list, and goes on compiling such programs after the list stopped at MAP_BUDGET,
    up to WANTED_BUDGET."""
    import jaxspec.server.programs as programs_module
    from jaxspec.server.scheduler import Scheduler

    sched = Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), max_running_requests=2)
    progs = sched.programs
    progs.lazy = False
    done: list[tuple] = []
    # the map usage grows with each compile: under MAP_BUDGET, between the budgets, over WANTED_BUDGET
    levels = [100, 0.75 * 65_530, 0.9 * 65_530]
    monkeypatch.setattr(programs_module, "map_usage", lambda: (levels[min(len(done), 2)], 65_530))
    monkeypatch.setattr(progs, "compile", done.append)
    idle = threading.Event()  # the background compiles only while the scheduler is idle
    monkeypatch.setattr(sched, "idle_for", lambda seconds: idle.is_set())
    monkeypatch.setattr(progs, "idle_only", True)
    first, second = ("dispatch", 2, 128, True, OFF, False, False), ("dispatch", 2, 256, True, OFF, False, False)
    progs.want(first)  # no background thread yet: nothing to ask
    assert not progs.wanted
    with caplog.at_level("WARNING", logger="jaxspec.server"):
        progs.start_background()
        progs.want(first)
        progs.want(first)  # once per key
        idle.set()
        for _ in range(300):
            if "stopped after 1 programs" in caplog.text:
                break
            time.sleep(0.01)
        progs.want(second)
        for _ in range(300):
            if len(done) == 2:
                break
            time.sleep(0.01)
        # over WANTED_BUDGET now: the budgets are read when there is work, so the next key stops it
        progs.want(("dispatch", 2, 1024, True, OFF, False, False))
        progs._thread.join(30)
    assert not progs._thread.is_alive()
    assert done == [first, second]  # wanted first; the list stopped at MAP_BUDGET, the wanted key still compiled
    assert "stopped for good after 2 programs" in caplog.text
    assert progs.background_done == progs.background_total == 2
    progs.want(("dispatch", 1, 64, True, OFF, False, False))  # stopped for good: nothing more is asked
    assert progs.background_total == 2 and not progs.wanted

"""Adaptive speculation: the choice between the tree shape and plain steps, and that every mix of
the two is lossless (greedy identical to plain decoding, sampling from the target distribution)
and keeps the draft in step with the target, in the offline engine and per server dispatch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxspec.config import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams
from jaxspec.speculative.adaptive import EXPLORE_MIN, OFF, PRIOR_ROUNDS, Adaptive, shape_label

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


def _forced(eng, order, rounds=1):
    """Makes eng's adaptive choice follow `order` (cycled; True = the tree shape, False = off), in
    blocks of `rounds` rounds."""
    shapes = itertools.cycle(order)
    eng.adaptive.rounds = rounds
    eng.adaptive.choose = lambda batch, surv, greedy, n_plain=0: eng.spec if next(shapes) else None
    return eng


def test_choice_follows_cost_and_acceptance():
    a = Adaptive(SPEC)
    one = np.array([True])
    surv = np.zeros((1, 3))
    assert a.choose(1, surv, one) is SPEC  # no cost measured yet: the tree shape first, then off
    a.cost[("2/1/3", 1)] = [0.06, 0.05, 0.07]
    assert a.choose(1, surv, one) is None
    a.cost[(OFF, 1)] = [0.035]
    assert a.choose(1, surv, one) is None  # measured twice before it counts
    a.cost[(OFF, 1)] = [0.035, 0.5, 0.03]  # one slow block does not decide
    # accept length 1.1 per round: 1.1 / 0.06 < 1 / 0.035
    low = np.array([[100.0, 10.0, 0.0]])
    picks = [a.choose(1, low, one) for _ in range(EXPLORE_MIN + 1)]
    assert picks[:EXPLORE_MIN] == [None] * EXPLORE_MIN and picks[-1] is SPEC  # then a look again
    assert a.choose(1, low, one) is None and a.explore_gap == 2 * EXPLORE_MIN  # confirmed: looks less often
    # accept length 2.5: 2.5 / 0.06 > 1 / 0.035
    high = np.array([[100.0, 90.0, 60.0]])
    assert a.choose(1, high, one) is SPEC
    assert a.explore_gap == EXPLORE_MIN
    # within the margin (1.68 / 0.06 is 2% short of 1 / 0.035): speculation goes on
    near = np.array([[1000.0, 530.0, 150.0]])
    assert a.choose(1, near, one) is SPEC
    # the prior of the request's kind, worth PRIOR_ROUNDS rounds
    a.prior = {True: np.array([10.0, 5.0, 2.0]), False: np.array([10.0, 1.0, 0.0])}
    w = PRIOR_ROUNDS
    assert a.expected_tokens(high, one)[0] == pytest.approx(1 + (90 + w * 0.5) / (100 + w) + (60 + w * 0.2) / (100 + w))
    none = np.zeros((2, 3))
    np.testing.assert_allclose(a.expected_tokens(none, np.array([True, False])), [1.7, 1.1])
    assert shape_label(SPEC) == "2/1/3" and shape_label(None) == OFF


@pytest.mark.parametrize(
    "algo,draft,knobs,target",
    [("STANDALONE", "target", (4, 1, 5), "target"), ("EAGLE3", "eagle3", (3, 2, 6), "target")],
)
def test_alternating_blocks_are_lossless(models, algo, draft, knobs, target):  # noqa: F811
    """Blocks alternate between the tree and plain steps: greedy output equals plain decoding, and
    with the target as its own draft every round after a plain block still accepts every draft
    token (the plain steps kept the draft's cache in step)."""
    eng = _forced(engine(models, algo, draft, knobs, target=target, speculative_adaptive=True), [True, False])
    sp = dict(GREEDY, max_new_tokens=60)
    ref = engine(models).generate(input_ids=PROMPTS, sampling_params=sp)
    out = eng.generate(input_ids=PROMPTS, sampling_params=sp)
    steps = knobs[0]
    for r, want in zip(out, ref):
        m = r["meta_info"]
        assert r["output_ids"] == want["output_ids"]
        assert m["spec_shapes"][OFF] > 0 and m["spec_shapes"][shape_label(eng.spec)] > 0
        assert sum(m["spec_shapes"].values()) == m["spec_verify_ct"]
        assert m["spec_accept_histogram"][0] >= m["spec_shapes"][OFF]  # a plain step emits one token
        if draft == "target":
            assert m["spec_accept_histogram"][1:steps] == [0] * (steps - 1), m["spec_accept_histogram"]
            assert m["spec_accept_histogram"][steps] > 0


@pytest.mark.parametrize("order", [[False], [False, True], [True, False]], ids=["off", "off-tree", "tree-off"])
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
    from server.scheduler import Request, Scheduler

    sched = Scheduler(eng, max_running_requests=slots, **kw)
    shapes = itertools.cycle(order)
    sched.adaptive.choose = lambda batch, surv, greedy, n_plain=0: eng.spec if next(shapes) else None
    res = {}
    for i, p in enumerate(prompts):
        emit = lambda e, i=i: res.__setitem__(i, e["result"]) if e["type"] == "done" else None
        sched.submit(Request(ids=p, params=SamplingParams.from_dict(params[i]), emit=emit))
    sched.run_until_idle()
    return [res[i] for i in range(len(prompts))], sched


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_server_dispatches_alternate_losslessly(models, overlap):  # noqa: F811
    """Server dispatches alternate between the tree shape and plain steps: greedy outputs equal the
    plain engine's, requests with a repetition penalty (which never speculate) keep their penalty in
    plain-step dispatches, and meta_info / Stats count the rounds of each shape."""
    pen = dict(GREEDY, repetition_penalty=1.5, frequency_penalty=0.5)
    params = [GREEDY, pen, GREEDY, pen]
    ref = [r["output_ids"] for r in engine(models).generate(input_ids=PROMPTS, sampling_params=params)]
    eng = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True)
    out, sched = _serve(eng, PROMPTS, params, [True, False, False], overlap=overlap)
    label = shape_label(eng.spec)
    for i, (r, want) in enumerate(zip(out, ref)):
        m = r["meta_info"]
        assert r["output_ids"] == want, i
        if i % 2 == 0:
            assert m["spec_shapes"][OFF] > 0 and m["spec_shapes"][label] > 0
            assert sum(m["spec_shapes"].values()) == m["spec_verify_ct"]
        else:
            assert not m["speculative"] and "spec_shapes" not in m
    st = sched.stats
    assert st.shape_dispatches[OFF] > 0 and st.shape_dispatches[label] > 0
    assert st.shape_rounds[OFF] >= st.shape_dispatches[OFF]


def test_server_measures_costs_and_acceptance(models, plain):  # noqa: F811
    """A real (unforced) adaptive scheduler measures a round of each candidate per batch size,
    collects each speculative request's acceptance (the target as its own draft accepts every
    draft token), and then runs mostly the candidate that its own measurements favour."""
    from server.scheduler import Request, Scheduler

    eng = engine(models, "STANDALONE", "target", (4, 1, 5), speculative_adaptive=True)
    sched = Scheduler(eng, max_running_requests=2, overlap=False)
    picks, choose = [], sched.adaptive.choose
    sched.adaptive.choose = lambda *a, **k: picks.append(choose(*a, **k)) or picks[-1]
    res = {}
    for i, p in enumerate(PROMPTS[:2]):
        emit = lambda e, i=i: res.__setitem__(i, e["result"]) if e["type"] == "done" else None
        sched.submit(Request(ids=p, params=SamplingParams.from_dict(dict(GREEDY, max_new_tokens=120)), emit=emit))
    sched.run_until_idle()
    a, label = sched.adaptive, shape_label(eng.spec)
    assert len(a.cost[(label, 2)]) >= 2 and len(a.cost[(OFF, 2)]) >= 2
    assert a.prior[True][4] > 0 and a.prior[True][4] == a.prior[True][0]  # every round accepted all 4 drafts
    speculate = 5 / a.round_cost(eng.spec, 2) > 1 / a.round_cost(None, 2)  # far from the margin either way
    later = picks[6:]  # after both costs were measured: mostly the better one (the rest: looking again)
    assert sum((c is not None) == speculate for c in later) > len(later) / 2, (a.cost, picks)
    for i, r in res.items():
        assert r["output_ids"][:24] == plain[len(PROMPTS[i])]
        shapes = r["meta_info"]["spec_shapes"]
        assert shapes[label] > 0 and shapes[OFF] > 0 and sum(shapes.values()) == r["meta_info"]["spec_verify_ct"]


def test_server_plain_step_programs_compile_in_the_background(models):  # noqa: F811
    """The plain-step twins of the start-up dispatches are background programs, and a call is
    served by one only once it is compiled (until then the tree shape serves it)."""
    from server.scheduler import Scheduler

    eng = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True)
    sched = Scheduler(eng, max_running_requests=2)
    progs = sched.programs
    progs.lazy = False
    startup = progs.startup_keys(2)
    bg = progs.background_keys()
    assert all(k[4] for k in startup if k[0] == "dispatch")
    assert {k[:4] + (False,) for k in startup if k[0] == "dispatch"} <= set(bg)
    assert progs.dispatch_key(1, 64, False, tree=False) is None
    progs.compile(("dispatch", 2, 128, True, False))
    assert progs.dispatch_key(1, 64, False, tree=False) == ("dispatch", 2, 128, True, False)
    assert progs.dispatch_key(1, 64, False, tree=True)[4] is True
    assert Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6)), max_running_requests=2).adaptive is None


def test_server_dispatch_programs_have_no_vocab_sort_and_no_branch(models):  # noqa: F811
    """Both kinds of sampled server dispatch (tree rounds, plain steps) compile to straight-line
    bodies: no sort over the vocabulary, no conditional."""
    from test_sampling import assert_no_vocab_sort_or_branch

    from server.scheduler import Scheduler

    from helpers import V

    sched = Scheduler(engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=True), max_running_requests=2)
    for tree in (True, False):
        hlo = sched.programs._lower(("dispatch", 2, 64, True, tree)).compile().as_text()
        assert_no_vocab_sort_or_branch(hlo, V)

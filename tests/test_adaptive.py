"""Adaptive speculation: the choice between the tree shape and plain steps, and that every mix of
the two is lossless (greedy identical to plain decoding, sampling from the target distribution)
and keeps the draft in step with the target."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxspec.config import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.speculative.adaptive import EXPLORE_MIN, OFF, PRIOR_ROUNDS, Adaptive, shape_label

from helpers import (  # noqa: F401 - models is a fixture
    GREEDY,
    PROMPTS,
    chi2_pvalue,
    engine,
    exact_pair_distribution,
    models,
    sample_pairs,
)

SPEC = SpecConfig("EAGLE3", "x", 2, 1, 3, adaptive=True)


def _forced(eng, order, rounds=1):
    """Makes eng's adaptive choice follow `order` (cycled; True = the tree shape, False = off), in
    blocks of `rounds` rounds."""
    shapes = itertools.cycle(order)
    eng.adaptive.rounds = rounds
    eng.adaptive.choose = lambda batch, surv, greedy: eng.spec if next(shapes) else None
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

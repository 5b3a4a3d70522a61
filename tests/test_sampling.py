"""Sampler: filters and penalties against numpy references, and the drawn distribution (chi-square)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.sampling import (
    DRAW_BLOCK,
    SamplingParams,
    SamplingTensors,
    apply_penalties,
    argmax,
    draw,
    draw_keyed,
    sample,
    target_probs,
)


def np_target_probs(logits, temperature, top_k, top_p, min_p):
    """Plain-numpy statement of SGLang's top-k / top-p / min-p filter on the full-vocabulary
    probabilities, by sorting: a token is kept when fewer than top_k tokens are more likely, the
    tokens more likely than it hold at most top_p, and it is at least min_p times the most likely
    (ties at a cut-off are kept or dropped together)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    zs, ps = z[order], p[order]
    # for each sorted position, the first position holding the same value: tokens strictly above
    first = np.searchsorted(-zs, -zs, side="left")
    above_count = first
    above_mass = np.concatenate([[0.0], np.cumsum(ps)])[first]
    keep = np.ones_like(ps, bool)
    if top_k > 0:
        keep &= above_count < top_k
    keep &= above_mass <= top_p + 1e-7
    keep &= ps >= min_p * ps[0] * (1 - 1e-6)
    out = np.zeros_like(p)
    out[order[keep]] = ps[keep]
    return out / out.sum()


CASES = [
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=-1, top_p=0.6, min_p=0.0),
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
]


def _tensors(cases, seeds=None):
    ps = [SamplingParams(**c) for c in cases]
    return SamplingTensors.build(ps, seeds or list(range(len(ps))))


@pytest.mark.parametrize("v", [12, 4096])
def test_filters_match_numpy(v):
    """At a small vocabulary and a large one where the cut-offs fall deep (top-k of thousands,
    top-p over a flat distribution, a tiny min-p)."""
    cases = CASES + [
        dict(temperature=2.0, top_k=v - 3, top_p=1.0, min_p=0.0),
        dict(temperature=3.0, top_k=-1, top_p=0.97, min_p=0.0),
        dict(temperature=2.5, top_k=-1, top_p=1.0, min_p=0.01),
        dict(temperature=1.5, top_k=v // 2, top_p=0.9, min_p=0.001),
    ]
    logits = np.random.default_rng(v).normal(size=(len(cases), v)).astype(np.float32) * 2
    got = np.asarray(target_probs(jnp.asarray(logits), _tensors(cases)))
    for i, c in enumerate(cases):
        want = np_target_probs(logits[i], c["temperature"], c["top_k"], c["top_p"], c["min_p"])
        assert ((got[i] > 0) == (want > 0)).all(), c
        np.testing.assert_allclose(got[i], want, atol=1e-6)


def test_threshold_search_loops_on_cpu_from_two_rows(monkeypatch):
    """Where the sampler skips unused work (XLA:CPU), the halvings of a search over two or more rows
    run as a loop (a fraction of a program's size) and find the same thresholds as straight-line
    code; one row, and programs built as for a GPU, stay straight-line."""
    from jaxspec import sampling

    cases = CASES + [dict(temperature=2.0, top_k=4000, top_p=0.9, min_p=0.001)]
    z = jnp.asarray(np.random.default_rng(1).normal(size=(len(cases), 4096)).astype(np.float32) * 3)
    st = _tensors(cases)
    loops = lambda zz, ss: "stablehlo.while" in jax.jit(sampling.kept_threshold).lower(zz, ss).as_text()
    monkeypatch.setattr(sampling, "SKIP_UNUSED", True)
    jax.clear_caches()
    looped = np.asarray(jax.jit(sampling.kept_threshold)(z, st))
    assert loops(z, st) and not loops(z[:1], jax.tree.map(lambda a: a[:1], st))
    monkeypatch.setattr(sampling, "SKIP_UNUSED", False)
    jax.clear_caches()
    assert not loops(z, st)
    np.testing.assert_array_equal(np.asarray(jax.jit(sampling.kept_threshold)(z, st)), looped)
    jax.clear_caches()


def test_ties_at_a_cut_off_are_kept_together():
    """top-k 2 over [3, 3, 3, 1, 0] keeps the three 3s; top-p 0.5 over two equal halves keeps both."""
    st = _tensors([dict(top_k=2), dict(top_p=0.5)])
    logits = jnp.asarray([[3.0, 3.0, 3.0, 1.0, 0.0], [0.0, 0.0, -1e9, -1e9, -1e9]])
    got = np.asarray(target_probs(logits, st))
    np.testing.assert_allclose(got[0], [1 / 3, 1 / 3, 1 / 3, 0, 0], atol=1e-6)
    np.testing.assert_allclose(got[1], [0.5, 0.5, 0, 0, 0], atol=1e-6)


def test_draw_never_picks_a_zero_weight():
    """The inverse-CDF draw at the ends of [0, 1) and over blocks of zeros picks positive entries."""
    v = 3 * DRAW_BLOCK + 5
    w = np.zeros((4, v), np.float32)
    w[0, [7, DRAW_BLOCK + 2]] = [1.0, 3.0]
    w[1, v - 1] = 1e-30
    w[2, :] = 1.0
    w[3, 2 * DRAW_BLOCK] = 2.0
    for u in (0.0, 0.25, 0.5, 1 - 2**-24):
        got = np.asarray(draw(jnp.asarray(w), jnp.full((4,), u, jnp.float32)))
        assert (w[np.arange(4), got] > 0).all(), (u, got)
    assert np.asarray(draw(jnp.asarray(w), jnp.full((4,), 0.2, jnp.float32)))[0] == 7


@pytest.fixture
def straight_line(monkeypatch):
    """Programs traced as for a GPU: the sampler computes every branch, with no conditional."""
    from helpers import straight_line_sampler

    straight_line_sampler(monkeypatch)


def test_sampler_program_has_no_sort_and_no_branch(straight_line):
    """The compiled sampler (filters and draw), as GPU programs build it, holds no sort over the
    vocabulary and no conditional, so a decoding step never waits on a predicate or sorts 50k
    entries."""
    v = 4096
    logits = jnp.zeros((2, v), jnp.float32)
    st = _tensors(CASES[:2])
    zeros = jnp.zeros((2, v), jnp.int32)
    hlo = jax.jit(sample).lower(logits, st, zeros, zeros > 0, st.keys).compile().as_text()
    assert_no_vocab_sort_or_branch(hlo, v)


def assert_no_vocab_sort_or_branch(hlo: str, v: int) -> None:
    """Fails if optimised HLO text sorts an operand with a dimension of v or more, or branches."""
    import re

    for line in hlo.splitlines():
        if re.search(r"\bsort\(", line) or " sort(" in line:
            dims = [int(d) for shape in re.findall(r"\[([\d,]+)\]", line) for d in shape.split(",") if d]
            assert max(dims, default=0) < v, line
        assert " conditional(" not in line, line


def test_penalties_match_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 10)).astype(np.float32)
    counts = np.array([[0, 2, 0, 1, 0, 0, 3, 0, 0, 0]], np.int32)
    seen = (counts > 0) | (np.arange(10) == 9)[None]
    st = _tensors([dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.25)])
    got = np.asarray(apply_penalties(jnp.asarray(logits), st, jnp.asarray(counts), jnp.asarray(seen)))
    want = logits.copy()
    want[seen] = np.where(want[seen] > 0, want[seen] / 1.5, want[seen] * 1.5)
    want = want - 0.4 * counts - 0.25 * (counts > 0)
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_sample_distribution_chi_square(case):
    """Thousands of draws from `sample` follow target_probs (chi-square test, p > 1e-3)."""
    from scipy.stats import chisquare

    n, v = 20000, 8
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, v)).astype(np.float32))
    st = _tensors([case])
    probs = np.asarray(target_probs(logits, st))[0].astype(np.float64)
    probs /= probs.sum()
    keys = jax.random.split(jax.random.key(5), n)
    zeros = jnp.zeros((1, v), jnp.int32)
    draw = jax.jit(jax.vmap(lambda k: sample(logits, st, zeros, zeros > 0, k[None])[0]))
    toks = np.asarray(draw(keys))
    obs = np.bincount(toks, minlength=v)
    assert obs[probs == 0].sum() == 0
    m = probs > 0
    assert chisquare(obs[m], probs[m] * n).pvalue > 1e-3
    # the test has power: a slightly different distribution is rejected
    skew = probs[m] * (1 + 0.1 * np.sign(np.arange(m.sum()) % 2 - 0.5))
    assert chisquare(obs[m], skew / skew.sum() * n).pvalue < 1e-3


def test_argmax_equals_jnp_argmax():
    """The two-reduction argmax against jnp.argmax: random rows, ties (the first one wins), -inf
    rows, NaN (the first NaN wins), several axes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 4099)).astype(np.float32)
    x[0, 0, [7, 300, 4000]] = 50.0  # a tie
    x[1, 1, :] = -np.inf
    x[2, 2, [9, 11]] = np.nan
    x[3, 0, :] = 1.0
    x[4, 1, -1] = np.inf
    for axis in (-1, 0, 1, 2):
        got = np.asarray(jax.jit(argmax, static_argnums=1)(jnp.asarray(x), axis))
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis)))
    assert argmax(jnp.asarray(x)).dtype == jnp.int32
    assert int(argmax(jnp.asarray(x))[0, 0]) == 7


def test_argmax_as_a_gpu_builds_it_equals_the_cpus():
    """The GPU's argmax (jnp.argmax's one reduction) and the CPU's two-reduction one agree on ties,
    -inf rows and NaN."""
    from jaxspec.compile_target import compiling_for

    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4099)).astype(np.float32)
    x[0, [7, 300]] = 50.0
    x[1, :] = -np.inf
    x[2, [9, 11]] = np.nan
    x[3, :] = 1.0
    with compiling_for("gpu"):
        gpu = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(gpu, np.asarray(argmax(jnp.asarray(x))))
    assert gpu.tolist() == [7, 0, 9, 0, int(np.argmax(x[4]))]


@pytest.mark.parametrize("v", [100, 16384, 49152, 50001, 128256])
def test_blocked_row_reductions_as_a_gpu_builds_them(v):
    """max_argmax / row_sum as a GPU builds them (rows longer than 16,384 reduced in blocks, then
    combined) against jnp: ties across blocks (the first wins), -inf rows, NaN (the first wins), a
    maximum in the last, padded block."""
    from jaxspec.compile_target import compiling_for
    from jaxspec.sampling import max_argmax
    from jaxspec.speculative.short_axis import row_sum

    rng = np.random.default_rng(v)
    x = rng.standard_normal((6, v)).astype(np.float32)
    x[0, [3, v // 2, v - 1]] = 50.0
    x[1, :] = -np.inf
    x[2, [v // 3, v - 2]] = np.nan
    x[3, -1] = 60.0
    x[4, :] = 1.0
    with compiling_for("gpu"):
        top, idx = jax.jit(max_argmax)(jnp.asarray(x))
        total = jax.jit(row_sum)(jnp.asarray(np.abs(np.nan_to_num(x, nan=0.0, neginf=0.0))))
    want = np.asarray(jnp.argmax(jnp.asarray(x), -1))
    np.testing.assert_array_equal(np.asarray(idx), want)
    np.testing.assert_array_equal(np.asarray(top), x[np.arange(6), want])
    np.testing.assert_allclose(np.asarray(total), np.abs(np.nan_to_num(x, nan=0.0, neginf=0.0)).sum(-1), rtol=1e-5)


def test_gumbel_draw_follows_the_weights():
    """draw_keyed as a GPU builds it (Gumbel-max over the vocabulary): chi-square against w / sum(w)
    with a power check, zero weights never drawn, and a row of w with nothing left drawn from its
    fallback while rows with something left never are."""
    from scipy.stats import chisquare

    from jaxspec.compile_target import compiling_for

    n, v = 20000, 8
    rng = np.random.default_rng(4)
    w = rng.dirichlet(np.ones(v), size=1).astype(np.float32)[0] * 3.0  # unnormalised
    w[2] = 0.0
    fb = rng.dirichlet(np.ones(v)).astype(np.float32)
    rows = np.stack([w, np.zeros(v, np.float32)])  # row 1: nothing left, its fallback draws
    keys = jax.random.split(jax.random.key(9), 2 * n).reshape(n, 2)
    with compiling_for("gpu"):
        fn = jax.jit(jax.vmap(lambda k: draw_keyed(jnp.asarray(rows), k, jnp.asarray(np.stack([fb, fb])))))
        toks = np.asarray(fn(keys))  # [n, 2]
    for col, weights in ((0, w), (1, fb)):
        dist = weights.astype(np.float64) / weights.astype(np.float64).sum()
        obs = np.bincount(toks[:, col], minlength=v)
        m = dist > 0
        assert obs[~m].sum() == 0
        assert chisquare(obs[m], dist[m] * n).pvalue > 1e-3
        skew = dist[m] * (1 + 0.1 * np.sign(np.arange(m.sum()) % 2 - 0.5))
        assert chisquare(obs[m], skew / skew.sum() * n).pvalue < 1e-3


def test_greedy_is_argmax_even_in_mixed_batch():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 50)).astype(np.float32))
    st = _tensors([dict(temperature=0.0), dict(temperature=1.0)])
    zeros = jnp.zeros((2, 50), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 2)
    toks = np.asarray(sample(logits, st, zeros, zeros > 0, keys))
    assert toks[0] == int(np.argmax(np.asarray(logits)[0]))


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=0),
        dict(min_p=2),
        dict(repetition_penalty=0),
        dict(frequency_penalty=3),
        dict(max_new_tokens=-1),
        dict(bogus=1),
        dict(n=2),
        dict(seed="x"),
    ],
)
def test_invalid_params_raise(bad):
    with pytest.raises(JaxspecError):
        SamplingParams.from_dict(bad)


def test_aliases():
    p = SamplingParams.from_dict({"max_tokens": 5, "sampling_seed": 3})
    assert p.max_new_tokens == 5 and p.seed == 3


MIXES = {
    "greedy": [dict(temperature=0.0, top_p=0.5), dict(temperature=0.0)],
    "temperature": [dict(temperature=0.0, top_k=3), dict(temperature=0.8)],
    "filtered": [dict(temperature=0.0), dict(CASES[4])],
    "all": CASES,
}


@pytest.mark.parametrize(
    "mix", [m if m in ("greedy", "all") else pytest.param(m, marks=pytest.mark.slow) for m in MIXES]
)  # "all" holds greedy, temperature-only and filtered rows at once
def test_skipping_unused_sampler_work_changes_no_token(mix, monkeypatch):
    """On CPU the sampler skips, by a conditional, the threshold search when no drawing row filters
    and the draw when no row draws. Each mix of rows gets the same tokens (same keys) from the
    skipping program as from the straight-line one GPUs run, in plain sampling and in tree
    verification, and the skipping programs branch without sorting the vocabulary."""
    from jaxspec import sampling
    from jaxspec.speculative.tree import build_tree
    from jaxspec.speculative.verify import verify

    rows, v = MIXES[mix], 4096
    b = len(rows)
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(0, 2, (b, v)).astype(np.float32))
    st = _tensors(rows, [11 * i + 1 for i in range(b)])
    zeros = jnp.zeros((b, v), jnp.int32)
    toks = jnp.asarray(rng.integers(0, v, (b, 3)), jnp.int32).at[:, 1].set(jnp.argmax(logits, -1))
    tree = build_tree(toks, jnp.broadcast_to(jnp.asarray([0, 0, 1], jnp.int32), (b, 3)), 2)
    tree_logits = jnp.stack([logits, jnp.roll(logits, 1, -1), jnp.roll(logits, 2, -1)], 1)
    ones = jnp.ones((b,))

    def run(skip):
        monkeypatch.setattr(sampling, "SKIP_UNUSED", skip)
        # st an argument: as in the server's programs, the predicates are not constants
        draw = jax.jit(lambda st: sample(logits, st, zeros, zeros > 0, st.keys))
        acc = jax.jit(lambda st: verify(tree, tree_logits, st, st.keys, 2, ones, ones))
        hlo = draw.lower(st).compile().as_text() + acc.lower(st).compile().as_text()
        return np.asarray(draw(st)), jax.tree_util.tree_map(np.asarray, acc(st)), hlo

    tok_skip, acc_skip, hlo = run(True)
    tok_all, acc_all, _ = run(False)
    np.testing.assert_array_equal(tok_skip, tok_all)
    for a, c in zip(jax.tree_util.tree_leaves(acc_skip), jax.tree_util.tree_leaves(acc_all), strict=True):
        np.testing.assert_array_equal(a, c)
    assert " conditional(" in hlo
    assert_no_vocab_sort_or_branch(hlo.replace(" conditional(", " branch("), v)


def test_temperature_only_sampler_skips_the_threshold_search(straight_line):
    """Requests that filter nothing get the sampler without the threshold search (32 passes over the
    vocabulary): the same weights, so the same draws, from a program a fraction of the size;
    sampling_kind picks it only when no drawing request filters."""
    from jaxspec.sampling import TEMPERATURE_ONLY, kept_weights, sampling_kind

    v = 49152
    rng = np.random.default_rng(3)
    # scaled logits and low temperatures: masses whose float32 sum rounds above 1 (the search once cut
    # tails at top_p = 1 there)
    logits = jnp.asarray((rng.normal(size=(3, v)) * rng.uniform(1, 8, (3, 1))).astype(np.float32))
    for t in (0.3, 0.7, 1.5):
        st = _tensors([dict(CASES[0], temperature=t), dict(temperature=0.0), dict(CASES[0], temperature=t / 2)])
        np.testing.assert_array_equal(np.asarray(kept_weights(logits, st, False)), np.asarray(kept_weights(logits, st)))
    zeros = jnp.zeros((3, v), jnp.int32)
    run = lambda kind: jax.jit(lambda k: sample(logits, st, zeros, zeros > 0, k, kind))
    keys = jax.random.split(jax.random.key(0), 3)
    assert np.array_equal(run(TEMPERATURE_ONLY)(keys), run(True)(keys))
    eqns = lambda kind: len(jax.make_jaxpr(lambda k: sample(logits, st, zeros, zeros > 0, k, kind))(keys).eqns)
    assert eqns(TEMPERATURE_ONLY) < eqns(True) / 4

    p = lambda **kw: SamplingParams(**kw)
    assert sampling_kind([p(temperature=0.0), p(temperature=0.0, top_k=5)]) is False
    assert sampling_kind([p(temperature=1.0), p(temperature=0.0, top_p=0.5)]) == TEMPERATURE_ONLY
    for filt in (dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05)):
        assert sampling_kind([p(temperature=1.0), p(temperature=0.8, **filt)]) is True

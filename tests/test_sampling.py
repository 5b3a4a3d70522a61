"""Sampler: filters and penalties against numpy references, and the drawn distribution (chi-square)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams, SamplingTensors, apply_penalties, sample, target_probs


def np_target_probs(logits, temperature, top_k, top_p, min_p):
    """Plain-numpy statement of SGLang's top-k -> top-p -> min-p filter."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    keep = np.ones_like(ps, bool)
    if top_k > 0:
        keep[top_k:] = False
    keep &= (np.cumsum(ps) - ps) <= top_p
    keep &= ps >= min_p * ps[0]
    keep[0] = True
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


def test_filters_match_numpy():
    logits = np.random.default_rng(0).normal(size=(len(CASES), 12)).astype(np.float32) * 2
    got = np.asarray(target_probs(jnp.asarray(logits), _tensors(CASES)))
    for i, c in enumerate(CASES):
        np.testing.assert_allclose(
            got[i], np_target_probs(logits[i], c["temperature"], c["top_k"], c["top_p"], c["min_p"]), atol=1e-6
        )


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


@pytest.mark.parametrize("case", [CASES[0], CASES[4]])
def test_sample_distribution_chi_square(case):
    """Thousands of draws from `sample` follow target_probs (chi-square test, p > 1e-3)."""
    from scipy.stats import chisquare

    n, v = 20000, 8
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, v)).astype(np.float32))
    st = _tensors([case])
    probs = np.asarray(target_probs(logits, st))[0]
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

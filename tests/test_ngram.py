"""NGRAM: matching, trie/tree building (BFS and PROB), the shared corpus, flag validation, and
end-to-end losslessness (tiny random target; SmolLM2 in the slow test) and sampling."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.speculative.proposers.ngram import SEP, TOP_K_BLOCK, Corpus, match_occurrences, ngram_tree, top_k

from helpers import (  # noqa: F401 - models and plain are fixtures
    GREEDY,
    PROMPTS,
    chi2_pvalue,
    engine,
    exact_pair_distribution,
    models,
    ngram_config,
    plain,
    resolve_spec,
    sample_pairs,
)

# history 1 2 3 4 | 1 2 3 5 | 1 2 3 4 | 1 2, x_L = 2: the suffix "3 4 1 2" occurs once in full
# (followed by 3 5 1 2 3), "1 2" occurs three times.
HIST = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2]


def tree_for(hist, n, pad=4, **kw):
    cfg = ngram_config(**{"max_match_window_size": 4, "branch_length": 6, **kw})
    seq = jnp.asarray([hist + [SEP] * pad], jnp.int32)
    t = ngram_tree(seq, jnp.asarray([len(hist)]), jnp.asarray([hist[-1]]), cfg, n)
    return [np.asarray(x)[0].tolist() for x in (t.tokens, t.parent, t.depth)]


@pytest.mark.parametrize("t", [TOP_K_BLOCK * 32 + 1, 5000, 18433])
@pytest.mark.parametrize("fill", [0.0, 0.002, 0.3, 1.0])
def test_top_k_blocks_equal_top_k(t, fill):
    """The blocked CPU top_k picks what jax.lax.top_k picks over distinct entries and -1s (the
    -1s' order aside), occurrences few (fewer than k), many, or none."""
    import jax

    rng = np.random.default_rng(t)
    x = np.where(rng.random((3, t)) < fill, rng.permutation(3 * t).reshape(3, t), -1)
    x[1, -1] = 10 * t  # the largest entry in the last, padded block
    x = jnp.asarray(x, jnp.int32)
    for k in (1, 32):
        v, i = top_k(x, k)
        rv, ri = jax.lax.top_k(x, k)
        assert (np.asarray(v) == np.asarray(rv)).all()
        assert ((np.asarray(i) == np.asarray(ri)) | (np.asarray(v) < 0)).all()
        assert (np.asarray(i) < t).all()


def test_match_occurrences():
    seq = jnp.asarray([HIST + [SEP] * 4], jnp.int32)
    suffix = jnp.asarray([[2, 1, 4, 3]], jnp.int32)
    pos, mlen = match_occurrences(seq, jnp.asarray([len(HIST)]), suffix, 1, 4)
    assert pos[0].tolist()[:3] == [5, 9, 1]  # longest match first, then the most recent
    assert mlen[0].tolist() == [4, 2, 2, 0]  # the suffix itself (index 13) is not an occurrence
    pos, mlen = match_occurrences(seq, jnp.asarray([len(HIST)]), suffix, 3, 4)  # min window 3
    assert mlen[0].tolist() == [4, 0, 0, 0]


def test_prob_tree_takes_the_most_frequent_nodes():
    tokens, parent, depth = tree_for(HIST, 6, match_type="PROB")
    # counts: "3" x3, "3 4" x2, "3 4 1" x2, "3 4 1 2" x2, then "3 5" (x1, shallowest of the rest)
    assert tokens == [2, 3, 4, 5, 1, 2]
    assert parent == [0, 0, 1, 1, 2, 4] and depth == [0, 1, 2, 2, 3, 4]


def test_bfs_breadth_follows_the_match_length():
    # windows 1..4, breadth 1..3: scale = (3 - 1) / (4 - 1 + 1) = 0.5
    # a 4-token match (the max window): breadth 1, a chain along the longest match's continuation
    tokens, parent, _ = tree_for(HIST, 6, min_bfs_breadth=1, max_bfs_breadth=3)
    assert tokens == [2, 3, 5, 1, 2, 3] and parent == [0, 0, 1, 2, 3, 4]
    # only 1-token matches of "2", most recent first: 5 9 2 | 7 6 2 5 | 8 0 2 7 | 7 0 2 8
    # breadth 2.5 -> 2 at the top, 2.0 -> 2 one level down, 1.5 -> 1 below that
    hist = [2, 7, 0, 2, 8, 0, 2, 7, 6, 2, 5, 9, 2]
    tokens, parent, depth = tree_for(hist, 7, min_bfs_breadth=1, max_bfs_breadth=3)
    assert tokens == [2, 5, 7, 9, 6, 0, 2] and parent == [0, 0, 0, 1, 2, 2, 3] and depth == [0, 1, 1, 2, 2, 2, 3]


def test_padding_when_matches_run_out():
    tokens, parent, depth = tree_for([4, 5, 6, 4], 8)  # "4" occurs once, followed by 5 6 4
    assert tokens[:4] == [4, 5, 6, 4] and parent[:4] == [0, 0, 1, 2]
    assert parent[4:] == [4, 5, 6, 7]  # padding nodes are their own parents: never reachable
    tokens, parent, _ = tree_for([1, 2, 3], 4)  # no earlier occurrence of 3: all padding
    assert parent == [0, 1, 2, 3]


def test_corpus_keeps_the_newest_tokens():
    c = Corpus(capacity=10, reserve=64)
    c.add([[1, 2, 3], [4, 5]])
    assert c.buf.tolist() == [1, 2, 3, SEP, 4, 5, SEP]
    c.add([[6, 7, 8, 9]])
    assert c.buf.tolist() == [3, SEP, 4, 5, SEP, 6, 7, 8, 9, SEP]  # oldest dropped first
    d = np.asarray(c.device())
    assert len(d) == 64 and d[-10:].tolist() == c.buf.tolist() and (d[:-10] == SEP).all()


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(match_type="DFS"), "BFS or PROB"),
        (dict(branch_length=1), "branch_length must be > 1"),
        (dict(min_match_window_size=0), "min_match_window_size"),
        (dict(min_match_window_size=5, max_match_window_size=4), "min_match_window_size"),
        (dict(max_match_window_size=18), "branch_length"),
        (dict(min_bfs_breadth=0), "min_bfs_breadth"),
        (dict(min_bfs_breadth=4, max_bfs_breadth=3), "max_bfs_breadth"),
        (dict(capacity=0), "capacity"),
    ],
)
def test_validation(kw, msg):
    with pytest.raises(JaxspecError, match=msg):
        ngram_config(**kw)


def test_resolution(monkeypatch):
    s = resolve_spec("ngram")
    assert s.algorithm == "NGRAM" and s.num_draft_tokens == 12 and s.num_steps == 11 and s.ngram.match_type == "BFS"
    assert s.ngram == ngram_config()  # SGLang's defaults
    assert resolve_spec("NGRAM", num_draft_tokens=6, ngram={"match_type": "prob"}).ngram.match_type == "PROB"
    assert not s.ngram.force_greedy_verify
    monkeypatch.setenv("JAXSPEC_NGRAM_FORCE_GREEDY_VERIFY", "1")
    assert resolve_spec("NGRAM").ngram.force_greedy_verify
    with pytest.raises(JaxspecError, match=">= 2"):
        resolve_spec("NGRAM", num_draft_tokens=1)


def ngram_engine(models, **kw):  # noqa: F811
    from jaxspec.engine import Engine

    return Engine(
        models["target"],
        skip_tokenizer_init=True,
        show_progress=False,
        chunked_prefill_size=4,
        speculative_algorithm="NGRAM",
        **kw,
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(speculative_ngram_match_type="PROB"),
        dict(speculative_num_draft_tokens=4, speculative_ngram_max_bfs_breadth=2),
    ],
)
def test_greedy_identical_to_plain(models, plain, kw):  # noqa: F811
    eng = ngram_engine(models, **kw)
    long = dict(GREEDY, max_new_tokens=48)
    out = eng.generate(input_ids=PROMPTS, sampling_params=long)
    ref = engine(models).generate(input_ids=PROMPTS, sampling_params=long)
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in ref]
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in out)
    assert rounds < sum(len(r["output_ids"]) for r in out) - len(
        out
    )  # a tiny random model repeats itself: matches get accepted
    # the second call also matches against the first call's text (the shared corpus)
    held = sum(len(p) + len(r["output_ids"]) + 1 for p, r in zip(PROMPTS, out))  # a separator after each
    assert eng.shared_text_stats() == dict(tokens=held, capacity=eng.spec.ngram.capacity, device_tokens=4096)
    again = eng.generate(input_ids=PROMPTS, sampling_params=long)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in ref]
    assert sum(r["meta_info"]["spec_verify_ct"] for r in again) < rounds


def test_shared_text_in_metrics(models):  # noqa: F811
    """The server reports the shared text's size and bound (Prometheus gauges)."""
    from jaxspec.server.metrics import prometheus_text
    from jaxspec.server.scheduler import Scheduler

    eng = ngram_engine(models, speculative_ngram_capacity=10)
    eng.feed_ngram_corpus([[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])  # 12 tokens with separators: the oldest 2 go
    text = prometheus_text(Scheduler(eng, max_running_requests=1), "m")
    assert 'jaxspec:spec_shared_text_tokens{model_name="m"} 10' in text
    assert 'jaxspec:spec_shared_text_capacity{model_name="m"} 10' in text
    assert engine(models).shared_text_stats() is None


@pytest.mark.slow
def test_sampling_matches_target_distribution(models):  # noqa: F811
    prompt, temp, n = [3, 1, 4], 1.0, 4096
    probs = exact_pair_distribution(models["hf"], prompt, temp)
    eng = ngram_engine(models, max_running_requests=512, speculative_num_draft_tokens=6)
    eng.generate(
        input_ids=[[3, 1, 4, 1, 3, 1, 4, 2, 3, 1, 4, 5]] * 4, sampling_params=dict(GREEDY, max_new_tokens=8)
    )  # seed the corpus
    assert chi2_pvalue(sample_pairs(eng, prompt, n, temp), probs) > 1e-3


@pytest.mark.slow
def test_force_greedy_verify(models):  # noqa: F811
    """Sampling requests are verified greedily: after the first token (sampled from the prefill),
    every token is the target's argmax, i.e. the greedy continuation of prompt + first token."""
    eng = ngram_engine(models, speculative_ngram_force_greedy_verify=True)
    out = eng.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, temperature=1.0, seed=3))
    ref = engine(models).generate(
        input_ids=[p + r["output_ids"][:1] for p, r in zip(PROMPTS, out)],
        sampling_params=dict(GREEDY, max_new_tokens=23),
    )
    assert [r["output_ids"][1:] for r in out] == [r["output_ids"] for r in ref]

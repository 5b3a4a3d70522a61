"""Tree construction and acceptance against plain-Python reference implementations on random trees."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.errors import JaxspecError
from jaxspec.speculative.tree import Candidates, build_tree, rerank
from jaxspec.speculative.verify import greedy_verify, sample_accept

from helpers import resolve_spec


def random_candidates(rng, k, steps):
    """Candidates as grow() lays them out: k roots, then per step k*k children of k beams."""
    toks, scores, parents = list(rng.integers(0, 50, k)), list(np.sort(rng.random(k))[::-1]), [-1] * k
    beams = list(range(k))
    for _ in range(1, steps):
        start = len(toks)
        for bm in beams:
            p = np.sort(rng.random(k))[::-1]
            for c in range(k):
                toks.append(int(rng.integers(0, 50)))
                scores.append(scores[bm] * p[c])
                parents.append(bm)
        block = np.arange(start, len(toks))
        beams = list(block[np.argsort(-np.asarray(scores)[block], kind="stable")[:k]])
    return np.asarray(toks), np.asarray(scores, np.float32), np.asarray(parents)


def py_rerank(toks, scores, parents, n):
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: n - 1]
    sel = sorted(order)
    node = {c: i + 1 for i, c in enumerate(sel)}
    parent = [0] + [node.get(parents[c], 0) for c in sel]
    depth = [0] * n
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
        anc[i] |= anc[parent[i]]
    return [int(toks[c]) for c in sel], parent, depth, anc


@pytest.mark.parametrize("k,steps,n", [(1, 4, 5), (2, 3, 6), (4, 5, 8), (8, 3, 16), (3, 4, 10)])
def test_rerank_matches_python(k, steps, n):
    rng = np.random.default_rng(k * 100 + steps)
    for _ in range(5):
        toks, scores, parents = random_candidates(rng, k, steps)
        cand = Candidates(jnp.asarray(toks)[None], jnp.asarray(scores)[None], jnp.asarray(parents)[None])
        tree = rerank(jnp.asarray([7]), cand, n, steps)
        ptoks, pparent, pdepth, panc = py_rerank(toks, scores, parents, n)
        assert np.asarray(tree.tokens)[0].tolist() == [7] + ptoks
        assert np.asarray(tree.parent)[0].tolist() == pparent
        assert np.asarray(tree.depth)[0].tolist() == pdepth
        np.testing.assert_array_equal(np.asarray(tree.anc)[0], panc)


def random_tree(rng, n, max_depth):
    parent = [0]
    depth = [0]
    for i in range(1, n):
        choices = [j for j in range(i) if depth[j] < max_depth]
        p = int(rng.choice(choices))
        parent.append(p)
        depth.append(depth[p] + 1)
    toks = rng.integers(0, 6, n)
    return toks, np.asarray(parent)


def py_greedy(toks, parent, target, steps):
    cur, path = 0, [0]
    for _ in range(steps):
        nxt = [c for c in range(1, len(toks)) if parent[c] == cur and toks[c] == target[cur]]
        if not nxt:
            break
        cur = nxt[0]
        path.append(cur)
    return len(path) - 1, path, target[cur]


def test_greedy_verify_matches_python():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, steps = int(rng.integers(2, 12)), int(rng.integers(1, 5))
        toks, parent = random_tree(rng, n, steps)
        logits = rng.normal(size=(n, 6)).astype(np.float32)
        tree = build_tree(jnp.asarray(toks)[None], jnp.asarray(parent, jnp.int32)[None], steps)
        acc = greedy_verify(tree, jnp.asarray(logits)[None], steps)
        num, path, bonus = py_greedy(toks, parent, logits.argmax(-1), steps)
        assert int(acc.num[0]) == num and int(acc.bonus[0]) == bonus
        assert np.asarray(acc.path)[0, : num + 1].tolist() == path


def py_sample_accept(toks, parent, probs, coins, steps, ts, ta):
    cur, path = 0, [0]
    for _ in range(steps):
        acc, chosen = 0.0, None
        kids = [c for c in range(1, len(toks)) if parent[c] == cur]
        for c in kids:
            pc = probs[cur, toks[c]]
            acc += pc
            if coins[cur] <= acc / ta or pc >= ts:
                chosen = c
                break
        if chosen is None:
            break
        cur = chosen
        path.append(cur)
    resid = probs[cur].copy()
    for c in range(1, len(toks)):
        if parent[c] == cur:
            resid[toks[c]] = 0
    return len(path) - 1, path, resid / resid.sum()


@pytest.mark.parametrize("ts,ta", [(1.0, 1.0), (0.3, 0.7)])
def test_sample_accept_matches_python(ts, ta):
    rng = np.random.default_rng(1)
    for _ in range(50):
        n, steps = int(rng.integers(2, 12)), int(rng.integers(1, 5))
        toks, parent = random_tree(rng, n, steps)
        probs = rng.dirichlet(np.ones(6) * 0.5, size=n).astype(np.float32)
        coins = rng.random(n).astype(np.float32)
        tree = build_tree(jnp.asarray(toks)[None], jnp.asarray(parent, jnp.int32)[None], steps)
        probs_d = jnp.asarray(probs)
        probs_at = lambda cur, probs_d=probs_d: probs_d[cur]
        num, path, resid = sample_accept(
            tree, probs_at, jnp.asarray(coins)[None], steps, jnp.asarray([ts]), jnp.asarray([ta])
        )
        pnum, ppath, presid = py_sample_accept(toks, parent, probs, coins, steps, ts, ta)
        assert int(num[0]) == pnum and np.asarray(path)[0, : pnum + 1].tolist() == ppath
        np.testing.assert_allclose(np.asarray(resid)[0], presid, atol=1e-5)


LLAMA = ModelConfig.from_hf(
    dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
)


def test_speculative_config_defaults_and_validation():
    s = resolve_spec("EAGLE3", LLAMA, draft_model_path="d")
    assert (s.num_steps, s.eagle_topk, s.num_draft_tokens) == (5, 4, 8)
    s = resolve_spec("STANDALONE", LLAMA, draft_model_path="d")
    assert (s.num_steps, s.eagle_topk, s.num_draft_tokens) == (3, 1, 4)
    assert resolve_spec("NEXTN", LLAMA, draft_model_path="d").algorithm == "EAGLE"
    assert not resolve_spec(None).enabled and not resolve_spec("none").enabled
    s = resolve_spec("EAGLE", LLAMA, draft_model_path="d", num_steps=3, eagle_topk=1, num_draft_tokens=8)
    assert s.num_draft_tokens == 4  # topk 1 forces a chain
    # SGLang's documented shapes: the tree holds 1 + topk + (num_steps - 1) * topk^2 nodes
    for knobs, n in [((3, 4, 16), 16), ((5, 8, 64), 64), ((2, 2, 8), 7), ((1, 4, 8), 5), ((2, 2, 6), 6)]:
        kw = dict(num_steps=knobs[0], eagle_topk=knobs[1], num_draft_tokens=knobs[2])
        assert resolve_spec("EAGLE", LLAMA, draft_model_path="d", **kw).num_draft_tokens == n
    for kw, match in [
        (dict(num_steps=3), "all three"),
        (dict(num_steps=0, eagle_topk=2, num_draft_tokens=2), ">= 1"),
        (dict(accept_threshold_acc=0.0), r"\(0, 1\]"),
    ]:
        with pytest.raises(JaxspecError, match=match):
            resolve_spec("EAGLE", LLAMA, draft_model_path="d", **kw)
    with pytest.raises(JaxspecError, match="draft_model_path"):
        resolve_spec("EAGLE", LLAMA)
    with pytest.raises(JaxspecError, match="unknown"):
        resolve_spec("MAGIC", LLAMA)

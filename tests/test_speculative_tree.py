"""Tree construction and acceptance against plain-Python reference implementations on random trees."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.errors import JaxspecError
from jaxspec.speculative.tree import Candidates, build_tree, normalised, rerank, target_index
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


def random_tree(rng, n, max_depth, pad=0.0):
    """Random parents (parent[i] < i) and tokens; with probability pad a node is padding, its own
    parent (as NGRAM's unused slots are), which no walk may reach whatever its token."""
    parent = [0]
    depth = [0]
    for i in range(1, n):
        if rng.random() < pad:
            parent.append(i)
            depth.append(max_depth + 1)
            continue
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
    for trial in range(80):
        n, steps = int(rng.integers(2, 12)), int(rng.integers(1, 5))
        toks, parent = random_tree(rng, n, steps, pad=0.3 if trial % 2 else 0.0)
        logits = rng.normal(size=(n, 6)).astype(np.float32)
        if trial % 4 == 1:  # padding nodes hold the very token the target wants after themselves
            toks = np.where(parent == np.arange(n), logits.argmax(-1), toks)
        tree = build_tree(jnp.asarray(toks)[None], jnp.asarray(parent, jnp.int32)[None], steps)
        acc = greedy_verify(tree, jnp.asarray(logits)[None], steps)
        num, path, bonus = py_greedy(toks, parent, logits.argmax(-1), steps)
        assert int(acc.num[0]) == num and int(acc.bonus[0]) == bonus
        assert np.asarray(acc.path)[0, : num + 1].tolist() == path


def bonus_distribution(resid, p_last):
    """sample_accept's bonus distribution (row 0): the residual normalised, or p where it is empty."""
    w = np.asarray(resid)[0]
    return w / w.sum() if w.sum() > 0 else np.asarray(p_last)[0]


def py_sample_accept(toks, parent, probs, coins, steps, ts, ta):
    """The target-only rule: py_spine_accept on a tree without a spine (one coin per node)."""
    n = len(toks)
    both = np.stack([coins, coins], 1)
    return py_spine_accept(toks, parent, np.zeros(n, bool), np.ones(n), None, None, probs, both, steps, ts, ta)


@pytest.mark.parametrize("ts,ta", [(1.0, 1.0), (0.3, 0.7)])
def test_sample_accept_matches_python(ts, ta):
    rng = np.random.default_rng(1)
    for trial in range(50):
        n, steps = int(rng.integers(2, 12)), int(rng.integers(1, 5))
        toks, parent = random_tree(rng, n, steps, pad=0.3 if trial % 2 else 0.0)
        probs = rng.dirichlet(np.ones(6) * 0.5, size=n).astype(np.float32)
        coins = rng.random(n).astype(np.float32)
        tree = build_tree(jnp.asarray(toks)[None], jnp.asarray(parent, jnp.int32)[None], steps)
        num, path, resid, p_last = sample_accept(
            tree, jnp.asarray(probs)[None], jnp.asarray(coins)[None], steps, jnp.asarray([ts]), jnp.asarray([ta])
        )
        pnum, ppath, presid = py_sample_accept(toks, parent, probs, coins, steps, ts, ta)
        assert int(num[0]) == pnum and np.asarray(path)[0, : pnum + 1].tolist() == ppath
        np.testing.assert_allclose(bonus_distribution(resid, p_last), presid, atol=1e-5)


def py_spine_accept(toks, parent, spine, qx, qd, q_ids, probs, coins, steps, ts, ta):
    """The sampled-drafts rule: at each node its spine child c (if any) is accepted when
    u0 * q(c) * ta <= p(c) or p(c) >= ts; after its rejection p becomes max(p - q, 0) renormalised
    and the other children are tried against that by the target-only rule with coin u1."""
    n = len(toks)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1

    def resid_at(cur):
        p = probs[cur].astype(np.float64)
        kids = [c for c in range(1, n) if parent[c] == cur]
        sp = [c for c in kids if spine[c]]
        if sp:
            c = sp[0]
            q = np.zeros(probs.shape[1])
            q[q_ids] = qd[depth[c] - 1]
            q[toks[c]] = max(q[toks[c]], qx[c])
            r = np.maximum(p - q, 0)
            if r.sum() > 0:
                p = r / r.sum()
        return p, kids, sp

    cur, path = 0, [0]
    for _ in range(steps):
        r, kids, sp = resid_at(cur)
        chosen = None
        if sp:
            c = sp[0]
            pc = probs[cur, toks[c]]
            if pc > 0 and (coins[cur, 0] * qx[c] * ta <= pc or pc >= ts):
                chosen = c
        if chosen is None:
            acc = 0.0
            for c in kids:
                if spine[c]:
                    continue
                pc = r[toks[c]]
                acc += pc
                if pc > 0 and (coins[cur, 1] <= acc / ta or pc >= ts):
                    chosen = c
                    break
        if chosen is None:
            break
        cur = chosen
        path.append(cur)
    r, kids, _ = resid_at(cur)
    r = r.copy()
    for c in kids:
        if not spine[c]:
            r[toks[c]] = 0
    return len(path) - 1, path, r / r.sum()


@pytest.mark.parametrize("ts,ta", [(1.0, 1.0), (0.3, 0.8)])
def test_sampled_draft_accept_matches_python(ts, ta):
    """Trees with a spine of sampled drafts: the min(1, p / q) rule for spine children, the residual
    max(p - q, 0) for their siblings and the bonus (draft vocabulary mapped onto target ids; some
    spine nodes forced, with q = 0 and q(token) = 1)."""
    rng = np.random.default_rng(7)
    v, vd = 9, 6
    for trial in range(60):
        n, steps = int(rng.integers(2, 10)), int(rng.integers(1, 5))
        toks, parent = random_tree(rng, n, steps)
        spine = np.zeros(n, bool)
        cur = 0
        while True:  # the spine: each spine node's first child
            kids = [c for c in range(1, n) if parent[c] == cur]
            if not kids:
                break
            cur = kids[0]
            spine[cur] = True
        q_ids = np.sort(rng.choice(v, vd, replace=False)).astype(np.int32)
        qd = rng.dirichlet(np.ones(vd) * 0.7, size=steps).astype(np.float32)
        qx = np.where(spine, rng.random(n) * 0.9 + 0.05, 1.0).astype(np.float32)
        if trial % 5 == 0 and spine.any():  # a forced spine node
            f = int(rng.choice(np.flatnonzero(spine)))
            depth_f = 0
            c = f
            while c:
                c, depth_f = parent[c], depth_f + 1
            qd[depth_f - 1], qx[f] = 0, 1.0
        probs = rng.dirichlet(np.ones(v) * 0.5, size=n).astype(np.float32)
        coins = rng.random((n, 2)).astype(np.float32)
        tree = build_tree(jnp.asarray(toks)[None], jnp.asarray(parent, jnp.int32)[None], steps)
        tree = dataclasses.replace(
            tree,
            spine=jnp.asarray(spine)[None],
            qx=jnp.asarray(qx)[None],
            qd=jnp.asarray(qd)[None],
            q_index=target_index(jnp.asarray(q_ids), v),
        )
        num, path, resid, p_last = sample_accept(
            tree, jnp.asarray(probs)[None], jnp.asarray(coins)[None], steps, jnp.asarray([ts]), jnp.asarray([ta])
        )
        pnum, ppath, presid = py_spine_accept(toks, parent, spine, qx, qd, q_ids, probs, coins, steps, ts, ta)
        assert int(num[0]) == pnum and np.asarray(path)[0, : pnum + 1].tolist() == ppath
        np.testing.assert_allclose(bonus_distribution(resid, p_last), presid, atol=1e-5)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.slow)])
def test_sampled_drafts_follow_the_target(platform):
    """Drafts drawn by draw_drafts and verified by sample_verify: the first two emitted tokens follow
    the target's distribution (temperature 0.7, a draft unlike the target), and acceptance is the
    sum of min(p, q), not p(argmax q). Power: thr_acc = 0.8 is rejected on as many samples. Both
    as the CPU builds the programs (inverse-CDF draws) and as a GPU does (Gumbel-max draws)."""
    from jaxspec.compile_target import compiling_for

    with compiling_for(platform):
        _sampled_drafts_follow_the_target()


def _sampled_drafts_follow_the_target():
    from scipy.stats import chisquare

    from jaxspec.sampling import SamplingParams, SamplingTensors, noise
    from jaxspec.speculative.loop import draw_drafts
    from jaxspec.speculative.verify import sample_verify

    v, b, temp = 6, 60000, 0.7
    rng = np.random.default_rng(3)
    l0, l1 = rng.normal(0, 1.5, v), rng.normal(0, 1.5, (v, v))  # target logits: root, after t1
    d0, d1 = rng.dirichlet(np.ones(v)), rng.dirichlet(np.ones(v), size=v)  # draft probabilities
    st = SamplingTensors.build([SamplingParams(temperature=temp)] * b, list(range(b)))
    keys = st.keys
    x1, q0, _ = draw_drafts(jnp.broadcast_to(jnp.asarray(d0, jnp.float32), (b, v)), st.temperature, noise(keys, v))
    keys1 = jax.vmap(jax.random.fold_in, (0, None))(keys, 1)
    x2, q1, _ = draw_drafts(jnp.asarray(d1, jnp.float32)[x1], st.temperature, noise(keys1, v))
    toks = jnp.stack([jnp.zeros_like(x1), x1, x2], 1)
    tree = build_tree(toks, jnp.broadcast_to(jnp.asarray([0, 0, 1], jnp.int32), (b, 3)), 2)
    qd = normalised(jnp.stack([q0, q1], 1))  # [B, D, V] (draw_drafts' weights, normalised as grow does)
    qx = jnp.concatenate([jnp.ones((b, 1)), jnp.take_along_axis(qd, toks[:, 1:, None], 2)[:, :, 0]], 1)
    spine = jnp.broadcast_to(jnp.asarray([False, True, True]), (b, 3))
    tree = dataclasses.replace(tree, spine=spine, qx=qx, qd=qd, q_index=jnp.arange(v, dtype=jnp.int32))
    logits = jnp.stack(
        [
            jnp.broadcast_to(jnp.asarray(l0, jnp.float32), (b, v)),
            jnp.asarray(l1, jnp.float32)[x1],
            jnp.asarray(l1, jnp.float32)[x2],
        ],
        1,
    )
    p0 = np.exp(l0 / temp) / np.exp(l0 / temp).sum()
    p1 = np.exp(l1 / temp) / np.exp(l1 / temp).sum(1, keepdims=True)
    exact = p0[:, None] * p1
    q0_np = np.asarray(qd[0, 0])
    for ta, want_pass in [(1.0, True), (0.8, False)]:
        vkeys = jax.vmap(jax.random.fold_in, (0, None))(keys, 7)
        acc = sample_verify(tree, logits, st, vkeys, 2, jnp.ones((b,)), jnp.full((b,), ta))
        num, bonus = np.asarray(acc.num), np.asarray(acc.bonus)
        t1 = np.where(num >= 1, np.asarray(x1), bonus)
        nxt = rng.random(b)  # a second token the next round would draw when the first was the bonus
        fresh = (p1[t1].cumsum(1) < nxt[:, None]).sum(1).clip(0, v - 1)
        t2 = np.where(num >= 2, np.asarray(x2), np.where(num == 1, bonus, fresh))
        counts = np.zeros((v, v))
        np.add.at(counts, (t1, t2), 1)
        pv = chisquare(counts.reshape(-1), exact.reshape(-1) * b).pvalue
        if want_pass:
            assert pv > 1e-3, pv
            # the first draft is accepted at the rate sum min(p0, q0)
            np.testing.assert_allclose(np.mean(num >= 1), np.minimum(p0, q0_np).sum(), atol=0.01)
        else:
            assert pv < 1e-6, pv


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

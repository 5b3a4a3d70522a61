"""Tree verification: greedy and lossless sampling acceptance.

Sampled rows are accepted by one of two rules, both lossless with the thresholds at 1:
  target-only (SGLang's): drafts are the draft's most likely tokens, taken as certain (q = 1); at a
      node the children are tried in sibling order, child x accepted when the coin falls within
      the running sum of p(child); after rejections the bonus is drawn from p without them.
  sampled drafts (when the tree carries a spine; tree.py): a spine child x was drawn from the
      draft distribution q; it is accepted when u * q(x) <= p(x) (probability min(1, p(x) / q(x)),
      standard speculative sampling), and after its rejection p becomes max(p - q, 0),
      renormalised, against which its siblings are tried by the target-only rule (any candidates
      chosen without the target's coins are lossless there). A spine child is accepted with
      probability sum_x min(p(x), q(x)) instead of p(argmax q): at temperature 1 a draft close to
      the target is accepted far more often.

Inputs: the Tree, and target logits at every node [B, N, V]. Output `Accepted`:
  num [B]        accepted draft tokens (0..num_steps); the round emits num + 1 tokens
  path [B, D+1]  node indices of the accepted path, path[:, 0] = 0 (root), padded with the last
  bonus [B]      the target's token after the last accepted node
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.sampling import (
    TEMPERATURE_ONLY,
    SamplingTensors,
    argmax,
    draw,
    draws,
    skips_unused,
    target_probs,
    uniforms,
)
from jaxspec.speculative.tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accepted:
    num: jax.Array
    path: jax.Array
    bonus: jax.Array


def _walk(tree: Tree, num_steps: int, choose):
    """Walks from the root; choose(cur [B], is_child [B, N]) -> (found [B], child [B])."""
    b, n = tree.tokens.shape
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    num = jnp.zeros((b,), jnp.int32)
    path = [cur]
    node = jnp.arange(n)[None, :]
    for _ in range(num_steps):
        is_child = (tree.parent == cur[:, None]) & (node > 0)
        found, child = choose(cur, is_child)
        found &= alive
        cur = jnp.where(found, child, cur).astype(jnp.int32)
        num += found
        alive &= found
        path.append(cur)
    return cur, num, jnp.stack(path, 1)


def greedy_verify(tree: Tree, logits, num_steps: int) -> Accepted:
    """Accept the child whose token is the target's argmax at the current node."""
    target = argmax(logits)  # [B, N]

    def choose(cur, is_child):
        want = jnp.take_along_axis(target, cur[:, None], 1)  # [B, 1]
        ok = is_child & (tree.tokens == want)
        return jnp.any(ok, 1), jnp.argmax(ok, 1)

    cur, num, path = _walk(tree, num_steps, choose)
    return Accepted(num, path, jnp.take_along_axis(target, cur[:, None], 1)[:, 0])


def sample_accept(tree: Tree, probs_at, coins, num_steps: int, thr_single, thr_acc):
    """The acceptance walk of tree sampling. probs_at(node [B]) -> target probabilities [B, V] at
    that node of each row; coins: uniforms per node [B, N] (target-only rule), or [B, N, 2] with
    sampled drafts (the spine child's test, then its siblings').

    At the current node the coin u is compared with the running sum of target probabilities of
    the children in sibling order: the first child with u <= acc / thr_acc, or with
    p(child) >= thr_single, is accepted; the children before it are rejected. With no child
    accepted the walk stops; the bonus is then drawn from p with every child's token zeroed (all
    rejected). The target distribution is computed only at the nodes the walk visits (at most
    num_steps + 1 per row), not at every node of the tree.
    With sampled drafts (tree.spine set) a spine child x is tried first: accepted when
    u * q(x) * thr_acc <= p(x) or p(x) >= thr_single; once rejected, p becomes max(p - q, 0)
    renormalised, and the other children are tried against that by the rule above (second coin).
    Returns (num [B], path [B, D + 1], residual distribution [B, V] for the bonus)."""
    b, n = tree.tokens.shape
    spine = tree.spine
    rows = jnp.arange(b)

    def residual(cur, is_child):
        """(p at cur [B, V], p after its spine child's rejection [B, V], spine child exists [B], its
        index [B])."""
        p = probs_at(cur)
        if spine is None:
            return p, p, jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32)
        assert tree.qd is not None and tree.qx is not None and tree.q_ids is not None
        sp = is_child & spine
        has, idx = jnp.any(sp, 1), jnp.argmax(sp, 1)
        d = jnp.take_along_axis(tree.depth, idx[:, None], 1)[:, 0]
        q = jnp.take_along_axis(tree.qd, jnp.maximum(d - 1, 0)[:, None, None], 1)[:, 0]  # [B, Vd]
        q_t = jnp.zeros_like(p).at[:, tree.q_ids].set(q)
        # a forced spine child (q all 0, q(x) 1) was drawn with certainty
        tok = jnp.take_along_axis(tree.tokens, idx[:, None], 1)[:, 0]
        q_t = q_t.at[rows, tok].max(jnp.take_along_axis(tree.qx, idx[:, None], 1)[:, 0])
        r = jnp.maximum(p - q_t, 0.0)
        total = r.sum(-1, keepdims=True)
        r = jnp.where(has[:, None] & (total > 0), r / jnp.maximum(total, 1e-30), p)
        return p, r, has, idx

    def choose(cur, is_child):
        u = jnp.take_along_axis(coins, cur[:, None] if coins.ndim == 2 else cur[:, None, None], 1)[:, 0]
        p, r, has, idx = residual(cur, is_child)
        det = is_child if spine is None else is_child & ~spine
        pc = jnp.where(det, jnp.take_along_axis(r, tree.tokens, 1), 0.0)  # [B, N]
        u_det = u if coins.ndim == 2 else u[:, 1]
        # pc > 0: a child the target cannot produce (filtered, or masked by a grammar) is never
        # accepted, even by a coin of exactly 0
        ok = (
            det
            & (pc > 0)
            & ((u_det[:, None] <= jnp.cumsum(pc, axis=1) / thr_acc[:, None]) | (pc >= thr_single[:, None]))
        )
        if spine is None:
            return jnp.any(ok, 1), jnp.argmax(ok, 1)
        ps = jnp.take_along_axis(p, jnp.take_along_axis(tree.tokens, idx[:, None], 1), 1)[:, 0]
        qs = jnp.take_along_axis(tree.qx, idx[:, None], 1)[:, 0]
        ok_s = has & (ps > 0) & ((u[:, 0] * qs * thr_acc <= ps) | (ps >= thr_single))
        return ok_s | jnp.any(ok, 1), jnp.where(ok_s, idx, jnp.argmax(ok, 1))

    cur, num, path = _walk(tree, num_steps, choose)
    children = (tree.parent == cur[:, None]) & (jnp.arange(n)[None] > 0)
    p_cur, r, _, _ = residual(cur, children)
    det = children if spine is None else children & ~spine
    rejected = jnp.zeros(r.shape, bool).at[rows[:, None], tree.tokens].max(det)
    resid = jnp.where(rejected, 0.0, r)
    total = resid.sum(-1, keepdims=True)
    resid = jnp.where(total > 0, resid / jnp.maximum(total, 1e-30), p_cur)  # guard against rounding
    return num, path, resid


def sample_verify(
    tree: Tree, logits, st: SamplingTensors, key, num_steps: int, thr_single, thr_acc, filtered: bool = True
) -> Accepted:
    """Lossless tree sampling (the target-only rule, or sampled drafts' rule when the tree carries
    q) from the target distribution with the request's temperature / top-k / top-p / min-p. With both thresholds 1 the emitted tokens follow
    the target distribution exactly. key: typed PRNG keys [B]. filtered (static): False when no
    row filters (temperature only)."""
    b, n, _ = logits.shape
    coin_key, bonus_key = jax.vmap(lambda k: tuple(jax.random.split(k)))(key)
    shape = (n,) if tree.spine is None else (n, 2)
    coins = jax.vmap(lambda k: jax.random.uniform(k, shape))(coin_key)
    # the target distribution at every node at once [B, N, V]: one sampler in the program instead of
    # one per step of the walk (as much work for a chain, whose walk visits every node)
    per_node = jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), st)
    probs = target_probs(logits.reshape(b * n, -1), per_node, filtered).reshape(b, n, -1)
    probs_at = lambda cur: jnp.take_along_axis(probs, cur[:, None, None], 1)[:, 0]
    num, path, resid = sample_accept(tree, probs_at, coins, num_steps, thr_single, thr_acc)
    return Accepted(num, path, draw(resid, uniforms(bonus_key)))


def verify(
    tree: Tree, logits, st: SamplingTensors, key, num_steps: int, thr_single, thr_acc, sampled: bool | str = True
) -> Accepted:
    """Greedy rows (temperature 0) by argmax, the others by tree sampling. sampled (static): False
    when every row is greedy, so the program holds no sampler (no branch decides it at run time);
    TEMPERATURE_ONLY when no row filters."""
    logits = logits.astype(jnp.float32)
    g = greedy_verify(tree, logits, num_steps)
    if not sampled:
        return g
    is_greedy = ~draws(st)

    def mixed():
        s = sample_verify(tree, logits, st, key, num_steps, thr_single, thr_acc, sampled != TEMPERATURE_ONLY)
        pick = lambda a, c: jnp.where(is_greedy.reshape((-1,) + (1,) * (a.ndim - 1)), a, c)
        return jax.tree_util.tree_map(pick, g, s)

    if skips_unused():  # no row draws: the tree-sampling walk is skipped
        return jax.lax.cond(jnp.any(draws(st)), mixed, lambda: g)
    return mixed()

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
import functools

import jax
import jax.numpy as jnp

from jaxspec.sampling import (
    TEMPERATURE_ONLY,
    SamplingTensors,
    argmax,
    draw_keyed,
    draws,
    max_argmax,
    skips_unused,
    target_probs,
)
from jaxspec.speculative.short_axis import any_of, first_true, row_sum, running_sum
from jaxspec.speculative.tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accepted:
    num: jax.Array
    path: jax.Array
    bonus: jax.Array


def _walk(tree: Tree, num_steps: int, found, child):
    """The walk from the root, from what would happen at every node: found [B, N] (the walk moves on
    from node p: one of its children is accepted), child [B, N] (that child). -> (cur [B] the last
    node, num [B] accepted drafts, path [B, D + 1] (padded with cur)). A node is on the walk when
    every node from the root down to it (itself included) was its parent's accepted child: whole-
    tree elementwise work with no step-by-step dependence, which XLA fuses into a kernel or two
    where a walk of D dependent steps takes two or three per step on a GPU."""
    n = tree.tokens.shape[1]
    node = jnp.arange(n)
    at_parent = lambda a: jnp.take_along_axis(a, tree.parent, 1)
    chosen = (at_parent(found) & (at_parent(child) == node)) | (node == 0)  # [B, N]
    # [B, N] below the root (a padding node that is its own parent is not) and every ancestor (and
    # itself) chosen
    on = tree.anc[:, :, 0] & ~any_of(tree.anc & ~chosen[:, None, :])
    num = functools.reduce(jnp.add, [on[:, i].astype(jnp.int32) for i in range(n)]) - 1
    cur = first_true(on & (tree.depth == num[:, None]))
    path = [jnp.where(d <= num, first_true(on & (tree.depth == d)), cur) for d in range(num_steps + 1)]
    return cur, num, jnp.stack(path, 1)


def greedy_verify(tree: Tree, logits, num_steps: int, target=None) -> Accepted:
    """Accept the child whose token is the target's argmax at the current node. target: that
    argmax [B, N] where the caller has it."""
    target = argmax(logits) if target is None else target  # [B, N]

    ok = _kids(tree) & (tree.tokens[:, None, :] == target[:, :, None])  # [B, parent, child]
    cur, num, path = _walk(tree, num_steps, any_of(ok), first_true(ok))
    return Accepted(num, path, jnp.take_along_axis(target, cur[:, None], 1)[:, 0])


def _kids(tree: Tree):
    """[B, parent, child] bool: child's parent is parent (the root is no one's child)."""
    node = jnp.arange(tree.tokens.shape[1])
    return (tree.parent[:, None, :] == node[None, :, None]) & (node > 0)


def sample_accept(tree: Tree, probs, coins, num_steps: int, thr_single, thr_acc, greedy=None):
    """The acceptance walk of tree sampling. probs [B, N, V]: the target distribution at every node;
    coins: uniforms per node [B, N] (target-only rule), or [B, N, 2] with sampled drafts (the spine
    child's test, then its siblings'). greedy: None, or (rows [B] bool, target [B, N] argmax
    tokens): those rows walk as greedy_verify does (the child whose token is the target's argmax),
    so that a batch mixing greedy and sampling rows walks the tree once.

    At the current node the coin u is compared with the running sum of target probabilities of
    the children in sibling order: the first child with u <= acc / thr_acc, or with
    p(child) >= thr_single, is accepted; the children before it are rejected. With no child
    accepted the walk stops; the bonus is then drawn from p with every child's token zeroed (all
    rejected).
    With sampled drafts (tree.spine set) a spine child x is tried first: accepted when
    u * q(x) * thr_acc <= p(x) or p(x) >= thr_single; once rejected, p becomes max(p - q, 0)
    renormalised, and the other children are tried against that by the rule above (second coin).
    Every node's decision (the residuals over the vocabulary, each child's probability at its
    parent, which child the coin accepts) is made at once, as if the walk reached every node; the
    walk then only follows them (_walk).
    Returns (num [B], path [B, D + 1], the bonus's residual distribution [B, V] unnormalised, the
    target distribution at the last node [B, V]: the bonus's where rounding left the residual
    empty)."""
    b, n = tree.tokens.shape
    v = probs.shape[-1]
    spine = tree.spine
    kids = _kids(tree)  # [B, parent, child]
    r = probs  # [B, N, V] the distribution a node's other children are tried against
    has = jnp.zeros((b, n), bool)  # [B, N] the node has a spine child
    sidx = jnp.zeros((b, n), jnp.int32)  # [B, N] its index
    if spine is not None:
        assert tree.qd is not None and tree.qx is not None and tree.q_index is not None
        sp = kids & spine[:, None, :]
        has, sidx = any_of(sp), first_true(sp)
        # the draft distribution each node's spine child was drawn from (its depth is the node's
        # + 1), on the target vocabulary; a forced spine child (q all 0, q(x) 1) was certain
        depths = tree.qd.shape[1]
        q_d = jnp.take_along_axis(tree.qd, jnp.minimum(tree.depth, depths - 1)[:, :, None], 1)  # [B, N, Vd]
        qi = tree.q_index
        q = jnp.where(qi >= 0, jnp.take(q_d, jnp.maximum(qi, 0), axis=2), 0.0)  # [B, N, V] on the target vocabulary
        tok = jnp.take_along_axis(tree.tokens, sidx, 1)  # [B, N]
        qx = jnp.take_along_axis(tree.qx, sidx, 1)
        q = jnp.maximum(q, jnp.where(jnp.arange(v) == tok[:, :, None], qx[:, :, None], 0.0))
        res = jnp.maximum(probs - q, 0.0)
        total = row_sum(res, keepdims=True)
        r = jnp.where(has[:, :, None] & (total > 0), res / jnp.maximum(total, 1e-30), probs)
    at_tokens = lambda d: jnp.take_along_axis(d, jnp.broadcast_to(tree.tokens[:, None, :], (b, n, n)), 2)
    r_kids = at_tokens(r)  # [B, parent, child] each node's token in its parent's r
    p_kids = at_tokens(probs)
    det_kids = kids if spine is None else kids & ~spine[:, None, :]
    row = lambda a, cur: jnp.take_along_axis(a, cur.reshape((b,) + (1,) * (a.ndim - 1)), 1)[:, 0]

    # at every node p at once: u [B, N] or [B, N, 2] its coins; pc [B, p, child] the running test
    u_det = coins if coins.ndim == 2 else coins[..., 1]
    pc = jnp.where(det_kids, r_kids, 0.0)
    # pc > 0: a child the target cannot produce (filtered, or masked by a grammar) is never
    # accepted, even by a coin of exactly 0
    thr_a, thr_s = thr_acc[:, None, None], thr_single[:, None, None]
    ok = det_kids & (pc > 0) & ((u_det[:, :, None] <= running_sum(pc) / thr_a) | (pc >= thr_s))
    if greedy is not None:
        g_rows, target = greedy
        ok = jnp.where(g_rows[:, None, None], kids & (tree.tokens[:, None, :] == target[:, :, None]), ok)
    found, child = any_of(ok), first_true(ok)  # [B, N]
    if spine is not None:
        assert tree.qx is not None
        ps = jnp.take_along_axis(p_kids, sidx[:, :, None], 2)[:, :, 0]  # [B, N] p(spine child)
        qs = jnp.take_along_axis(tree.qx, sidx, 1)
        ok_s = has & (ps > 0) & ((coins[..., 0] * qs * thr_acc[:, None] <= ps) | (ps >= thr_single[:, None]))
        if greedy is not None:
            ok_s &= ~greedy[0][:, None]
        found, child = ok_s | found, jnp.where(ok_s, sidx, child)
    cur, num, path = _walk(tree, num_steps, found, child)
    det = row(det_kids, cur)  # [B, N] every such child of the last node was rejected
    rejected = any_of((tree.tokens[:, None, :] == jnp.arange(v)[None, :, None]) & det[:, None, :])
    return num, path, jnp.where(rejected, 0.0, row(r, cur)), row(probs, cur)


def sample_verify(
    tree: Tree,
    logits,
    st: SamplingTensors,
    key,
    num_steps: int,
    thr_single,
    thr_acc,
    filtered: bool = True,
    target=None,
) -> Accepted:
    """Lossless tree sampling (the target-only rule, or sampled drafts' rule when the tree carries
    q) from the target distribution with the request's temperature / top-k / top-p / min-p. With
    both thresholds 1 the emitted tokens follow the target distribution exactly. key: typed PRNG
    keys [B], or [2, B]: the coins' and the bonus's (made with others at once). filtered
    (static): False when no row filters (temperature only). target: (the logits' largest [B, N],
    their argmax [B, N]) (sampling.max_argmax); given, the greedy rows (temperature 0) are
    verified as greedy_verify does, in the same walk."""
    b, n, _ = logits.shape
    coin_key, bonus_key = (key[0], key[1]) if key.ndim == 2 else jax.vmap(lambda k: tuple(jax.random.split(k)))(key)
    shape = (n,) if tree.spine is None else (n, 2)
    coins = jax.vmap(lambda k: jax.random.uniform(k, shape))(coin_key)
    # the target distribution at every node at once [B, N, V]: one sampler in the program instead of
    # one per step of the walk (as much work for a chain, whose walk visits every node)
    per_node = jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), st)
    flat = logits.reshape(b * n, -1)
    # the logits' largest where the caller has it: a reduction fewer
    top = None if target is None else target[0].reshape(-1)
    probs = target_probs(flat, per_node, filtered, top).reshape(b, n, -1)
    greedy = None if target is None else (~draws(st), target[1])
    num, path, resid, p_last = sample_accept(tree, probs, coins, num_steps, thr_single, thr_acc, greedy)
    bonus = draw_keyed(resid, bonus_key, p_last)
    if greedy is not None:
        bonus = jnp.where(greedy[0], jnp.take_along_axis(greedy[1], path[:, -1:], 1)[:, 0], bonus)
    return Accepted(num, path, bonus)


def verify(
    tree: Tree, logits, st: SamplingTensors, key, num_steps: int, thr_single, thr_acc, sampled: bool | str = True
) -> Accepted:
    """Greedy rows (temperature 0) by argmax, the others by tree sampling. sampled (static): False
    when every row is greedy, so the program holds no sampler (no branch decides it at run time);
    TEMPERATURE_ONLY when no row filters."""
    logits = logits.astype(jnp.float32)
    if not sampled:
        return greedy_verify(tree, logits, num_steps, argmax(logits))
    top, target = max_argmax(logits)  # [B, N] each
    filtered = sampled != TEMPERATURE_ONLY
    mixed = lambda: sample_verify(tree, logits, st, key, num_steps, thr_single, thr_acc, filtered, (top, target))
    if skips_unused():  # no row draws: the tree-sampling walk is skipped
        return jax.lax.cond(jnp.any(draws(st)), mixed, lambda: greedy_verify(tree, logits, num_steps, target))
    return mixed()

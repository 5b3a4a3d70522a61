"""Tree verification: greedy and lossless sampling acceptance (SGLang's target-only rule).

Inputs: the Tree, and target logits at every node [B, N, V]. Output `Accepted`:
  num [B]        accepted draft tokens (0..num_steps); the round emits num + 1 tokens
  path [B, D+1]  node indices of the accepted path, path[:, 0] = 0 (root), padded with the last
  bonus [B]      the target's token after the last accepted node
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.sampling import GREEDY_EPS, TEMPERATURE_ONLY, SamplingTensors, draw, target_probs, uniforms
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
    target = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, N]

    def choose(cur, is_child):
        want = jnp.take_along_axis(target, cur[:, None], 1)  # [B, 1]
        ok = is_child & (tree.tokens == want)
        return jnp.any(ok, 1), jnp.argmax(ok, 1)

    cur, num, path = _walk(tree, num_steps, choose)
    return Accepted(num, path, jnp.take_along_axis(target, cur[:, None], 1)[:, 0])


def sample_accept(tree: Tree, probs_at, coins, num_steps: int, thr_single, thr_acc):
    """The acceptance walk of tree sampling. probs_at(node [B]) -> target probabilities [B, V] at
    that node of each row; coins: one uniform per node [B, N].

    At the current node the coin u is compared with the running sum of target probabilities of
    the children in sibling order: the first child with u <= acc / thr_acc, or with
    p(child) >= thr_single, is accepted; the children before it are rejected. With no child
    accepted the walk stops; the bonus is then drawn from p with every child's token zeroed (all
    rejected). The target distribution is computed only at the nodes the walk visits (at most
    num_steps + 1 per row), not at every node of the tree.
    Returns (num [B], path [B, D + 1], residual distribution [B, V] for the bonus)."""
    b, n = tree.tokens.shape

    def choose(cur, is_child):
        pc = jnp.where(is_child, jnp.take_along_axis(probs_at(cur), tree.tokens, 1), 0.0)  # [B, N]
        acc = jnp.cumsum(pc, axis=1)
        u = jnp.take_along_axis(coins, cur[:, None], 1)
        # pc > 0: a child the target cannot produce (filtered, or masked by a grammar) is never
        # accepted, even by a coin of exactly 0
        ok = is_child & (pc > 0) & ((u <= acc / thr_acc[:, None]) | (pc >= thr_single[:, None]))
        return jnp.any(ok, 1), jnp.argmax(ok, 1)

    cur, num, path = _walk(tree, num_steps, choose)
    p_cur = probs_at(cur)  # [B, V]
    children = (tree.parent == cur[:, None]) & (jnp.arange(n)[None] > 0)
    rejected = jnp.zeros(p_cur.shape, bool).at[jnp.arange(b)[:, None], tree.tokens].max(children)
    resid = jnp.where(rejected, 0.0, p_cur)
    total = resid.sum(-1, keepdims=True)
    resid = jnp.where(total > 0, resid / jnp.maximum(total, 1e-30), p_cur)  # guard against rounding
    return num, path, resid


def sample_verify(
    tree: Tree, logits, st: SamplingTensors, key, num_steps: int, thr_single, thr_acc, filtered: bool = True
) -> Accepted:
    """Lossless tree sampling (SGLang's target-only rule) from the target distribution with the
    request's temperature / top-k / top-p / min-p. With both thresholds 1 the emitted tokens follow
    the target distribution exactly. key: typed PRNG keys [B]. filtered (static): False when no
    row filters (temperature only)."""
    b, n, _ = logits.shape
    coin_key, bonus_key = jax.vmap(lambda k: tuple(jax.random.split(k)))(key)
    coins = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(coin_key)
    probs_at = lambda cur: target_probs(jnp.take_along_axis(logits, cur[:, None, None], 1)[:, 0], st, filtered)
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
    s = sample_verify(tree, logits, st, key, num_steps, thr_single, thr_acc, sampled != TEMPERATURE_ONLY)
    is_greedy = st.temperature <= GREEDY_EPS
    pick = lambda a, c: jnp.where(is_greedy.reshape((-1,) + (1,) * (a.ndim - 1)), a, c)
    return jax.tree_util.tree_map(pick, g, s)

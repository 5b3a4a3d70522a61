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

from jaxspec.sampling import SamplingTensors, target_probs
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


def sample_accept(tree: Tree, probs, coins, num_steps: int, thr_single, thr_acc):
    """The acceptance walk of tree sampling, given target probabilities [B, N, V] at every node and
    one uniform coin per node [B, N].

    At the current node the coin u is compared with the running sum of target probabilities of
    the children in sibling order: the first child with u <= acc / thr_acc, or with
    p(child) >= thr_single, is accepted; the children before it are rejected. With no child
    accepted the walk stops; the bonus is then drawn from p with every child's token zeroed (all
    rejected). Returns (num [B], path [B, D + 1], residual distribution [B, V] for the bonus)."""
    b, n, v = probs.shape
    # p_tok[b, i, m] = target probability at node i of node m's token
    p_tok = jnp.take_along_axis(probs, jnp.broadcast_to(tree.tokens[:, None, :], (b, n, n)), axis=2)

    def choose(cur, is_child):
        pc = jnp.where(is_child, jnp.take_along_axis(p_tok, cur[:, None, None], 1)[:, 0], 0.0)  # [B, N]
        acc = jnp.cumsum(pc, axis=1)
        u = jnp.take_along_axis(coins, cur[:, None], 1)
        ok = is_child & ((u <= acc / thr_acc[:, None]) | (pc >= thr_single[:, None]))
        return jnp.any(ok, 1), jnp.argmax(ok, 1)

    cur, num, path = _walk(tree, num_steps, choose)
    p_cur = jnp.take_along_axis(probs, cur[:, None, None], 1)[:, 0]  # [B, V]
    children = (tree.parent == cur[:, None]) & (jnp.arange(n)[None] > 0)
    rejected = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], tree.tokens].max(children)
    resid = jnp.where(rejected, 0.0, p_cur)
    total = resid.sum(-1, keepdims=True)
    resid = jnp.where(total > 0, resid / jnp.maximum(total, 1e-30), p_cur)  # guard against rounding
    return num, path, resid


def sample_verify(tree: Tree, logits, st: SamplingTensors, key, num_steps: int, thr_single, thr_acc) -> Accepted:
    """Lossless tree sampling (SGLang's target-only rule) from the target distribution with the
    request's temperature / top-k / top-p / min-p. With both thresholds 1 the emitted tokens follow
    the target distribution exactly. key: typed PRNG keys [B]."""
    b, n, v = logits.shape
    flat = jnp.repeat(jnp.arange(b), n)
    st_rep = jax.tree_util.tree_map(lambda x: x[flat], st)  # per node sampling params
    probs = target_probs(logits.reshape(b * n, v), st_rep).reshape(b, n, v)
    coin_key, bonus_key = jax.vmap(lambda k: tuple(jax.random.split(k)))(key)
    coins = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(coin_key)
    num, path, resid = sample_accept(tree, probs, coins, num_steps, thr_single, thr_acc)
    bonus = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(bonus_key, resid)
    return Accepted(num, path, bonus.astype(jnp.int32))


def verify(tree: Tree, logits, st: SamplingTensors, key, num_steps: int, thr_single, thr_acc) -> Accepted:
    """Greedy rows (temperature 0) by argmax, the others by tree sampling; sampling is skipped
    entirely when every row is greedy."""
    logits = logits.astype(jnp.float32)
    g = greedy_verify(tree, logits, num_steps)
    is_greedy = st.temperature <= 1e-6
    s = jax.lax.cond(
        jnp.all(is_greedy),
        lambda: g,
        lambda: sample_verify(tree, logits, st, key, num_steps, thr_single, thr_acc),
    )
    pick = lambda a, c: jnp.where(is_greedy.reshape((-1,) + (1,) * (a.ndim - 1)), a, c)
    return jax.tree_util.tree_map(pick, g, s)

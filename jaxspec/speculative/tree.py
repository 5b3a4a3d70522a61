"""Draft-tree growth (EAGLE-2 style) and the tree arrays that verification consumes.

Growth, with k = topk and `num_steps` draft forwards in all:
  step 0  the root's draft distribution (from the proposer's refresh) gives k depth-1 candidates,
          scored by their probability; they are the first beams.
  step j  (1 <= j < num_steps) the k beams are fed to the draft at once (tree-masked), each
          proposes k children scored parent_score * p(child); the best k of the k*k become beams.
All k + (num_steps - 1) * k^2 candidates are kept; `rerank` picks the N - 1 best by score, in
candidate order (parents always precede their children), below the root x_L.

Tree arrays per request (N nodes, node 0 = x_L):
  tokens [N], parent [N] (parent[0] = 0), depth [N], anc [N, N] (row = self + ancestors + root).
Siblings are ordered by decreasing draft probability (candidate order), which the sampling
verifier relies on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    tokens: jax.Array  # [B, N] int32 target-vocabulary ids, tokens[:, 0] = x_L
    parent: jax.Array  # [B, N] int32 node index of the parent (0 for the root itself)
    depth: jax.Array  # [B, N] int32
    anc: jax.Array  # [B, N, N] bool ancestor-or-self mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Candidates:
    tokens: jax.Array  # [B, M] int32
    scores: jax.Array  # [B, M] float32 product of draft probabilities along the path
    parent: jax.Array  # [B, M] int32 candidate index of the parent, -1 = root


def grow(
    root_probs,
    root_hidden,
    to_target,
    step_fn: Callable,
    num_steps: int,
    topk: int,
    root_in_region: bool,
    mask_fn: Callable | None = None,
):
    """Runs the draft steps and returns all scored candidates.

    root_probs: [B, Vd] draft probabilities for x_L's successor; root_hidden: [B, Hd] or None.
    to_target: maps draft-vocabulary ids to target ids.
    step_fn(tokens [B, k], hidden [B, k, Hd] | None, depth j, local_mask [B, k, W], offset) ->
        (probs [B, k, Vd], hidden_out [B, k, Hd] | None); it writes the beams' draft KV at region
        column offset + slot. Region column 0 holds the root when root_in_region (STANDALONE).
    mask_fn(paths [B, P, D] target tokens after x_L, lengths [B, P]) -> (bool [B, P, Vd], forced
        [B, P]): the draft tokens allowed after each path, and the target token the grammar forces
        there or -1 (constrained decoding). Each distribution is masked and renormalised; a forced
        token becomes the first child with probability 1 (also when the draft vocabulary lacks
        it), the others get 0. Siblings stay distinct tokens, which lossless verification needs.
    """
    b = root_probs.shape[0]
    k = topk

    def children(probs, paths, plen):  # probs [B, P, Vd] -> top-k (probabilities, target tokens)
        forced = None
        if mask_fn is not None:
            ok, forced = mask_fn(paths, plen)
            probs = jnp.where(ok, probs, 0.0)
            probs = probs / jnp.maximum(jnp.sum(probs, -1, keepdims=True), 1e-30)
        p, ids = jax.lax.top_k(probs, k)
        tok = to_target(ids).astype(jnp.int32)
        if forced is not None:  # forced first; a sibling that already held it takes the old first
            first = jnp.arange(k) == 0
            is_f, f = forced[..., None] >= 0, forced[..., None]
            moved = jnp.where(first, f, jnp.where(tok == f, tok[..., :1], tok))
            tok = jnp.where(is_f, moved, tok)
            p = jnp.where(is_f, first.astype(p.dtype), p)
        return p, tok

    r = int(root_in_region)
    w = max(r + (num_steps - 1) * k, 1)
    p0, tok0 = children(root_probs[:, None], jnp.zeros((b, 1, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32))
    p0, tok0 = p0[:, 0], tok0[:, 0]  # [B, k]
    toks = [tok0]
    scores = [p0]
    parents = [jnp.full((b, k), -1, jnp.int32)]
    beam_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index of each beam
    beam_score = p0
    beam_tok = toks[0]
    beam_path = beam_tok[:, :, None]  # [B, k, j] each beam's tokens after x_L
    beam_hidden = None if root_hidden is None else jnp.broadcast_to(root_hidden[:, None], (b, k, root_hidden.shape[-1]))
    col = jnp.arange(w)[None, None, :]
    beam_anc = jnp.broadcast_to((col == r + jnp.arange(k)[None, :, None]) | ((col == 0) & (r == 1)), (b, k, w))
    n_cand = k
    for j in range(1, num_steps):
        offset = r + (j - 1) * k
        probs, hidden = step_fn(beam_tok, beam_hidden, j, beam_anc, offset)
        p, tok = children(probs, beam_path, jnp.full((b, k), j, jnp.int32))  # [B, k(beam), k(child)]
        child_score = (beam_score[:, :, None] * p).reshape(b, k * k)
        child_tok = tok.reshape(b, k * k)
        toks.append(child_tok)
        scores.append(child_score)
        parents.append(jnp.repeat(beam_cand, k, axis=1))
        if j == num_steps - 1:
            break
        beam_score, pick = jax.lax.top_k(child_score, k)  # best k of k*k become the next beams
        parent_slot = pick // k
        beam_tok = jnp.take_along_axis(child_tok, pick, axis=1)
        beam_path = jnp.concatenate(
            [jnp.take_along_axis(beam_path, parent_slot[:, :, None], 1), beam_tok[:, :, None]], 2
        )
        beam_cand = n_cand + pick.astype(jnp.int32)
        if hidden is not None:
            beam_hidden = jnp.take_along_axis(hidden, parent_slot[:, :, None], axis=1)
        new_col = r + j * k + jnp.arange(k)[None, :, None]
        beam_anc = jnp.take_along_axis(beam_anc, parent_slot[:, :, None], axis=1) | (col == new_col)
        n_cand += k * k
    return Candidates(jnp.concatenate(toks, 1), jnp.concatenate(scores, 1), jnp.concatenate(parents, 1))


def rerank(root_tokens, cand: Candidates, num_draft_tokens: int, num_steps: int) -> Tree:
    """Keeps the best N - 1 candidates (ties go to the earlier one, so parents beat children)."""
    b = root_tokens.shape[0]
    n = num_draft_tokens
    _, sel = jax.lax.top_k(cand.scores, n - 1)
    sel = jnp.sort(sel, axis=1)  # candidate order: parents before children
    tokens = jnp.concatenate([root_tokens[:, None], jnp.take_along_axis(cand.tokens, sel, 1)], 1)
    pc = jnp.take_along_axis(cand.parent, sel, 1)  # [B, N-1] parent candidate index or -1
    match = sel[:, None, :] == pc[:, :, None]  # [B, N-1, N-1]
    parent = jnp.where(jnp.any(match, -1), jnp.argmax(match, -1) + 1, 0).astype(jnp.int32)
    parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent], 1)
    return build_tree(tokens, parent, num_steps)


def build_tree(tokens, parent, max_depth: int) -> Tree:
    """Depths and ancestor masks from parent pointers (parent[i] < i for i > 0)."""
    b, n = tokens.shape
    node = jnp.arange(n)[None, :]
    depth = jnp.zeros((b, n), jnp.int32)
    anc = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    for _ in range(max_depth):
        depth = jnp.where(node > 0, jnp.take_along_axis(depth, parent, 1) + 1, 0)
        anc = anc | jnp.take_along_axis(anc, parent[:, :, None], axis=1)
    return Tree(tokens.astype(jnp.int32), parent, depth, anc)


def node_paths(tree: Tree, max_depth: int):
    """Each node's tokens after the root, by depth: (paths [B, N, D] int32 (zero past the node's
    depth), lengths [B, N] = depth). D = max(max_depth, 1)."""
    d = jnp.arange(1, max(max_depth, 1) + 1)
    sel = tree.anc[..., None] & (tree.depth[:, None, :, None] == d)  # [B, node, ancestor, D]
    paths = jnp.sum(jnp.where(sel, tree.tokens[:, None, :, None], 0), axis=2)
    return paths.astype(jnp.int32), tree.depth

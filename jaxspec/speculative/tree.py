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

Sampled drafts: grow(draw=...) makes one path of a sampling row's tree, the spine, drawn from the
draft distribution q (each spine node's first child is a draw; its other children are the k - 1
most likely other tokens, as elsewhere). The tree then also carries which nodes are spine nodes,
q(token) for them and the q each was drawn from, so that verification can accept a spine child
by min(1, p / q) and its siblings by the target-only rule against the residual (verify.py). A
spine node is always kept, whatever its value: dropping draws by their value would bias them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxspec.speculative.short_axis import any_of, first_true


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    tokens: jax.Array  # [B, N] int32 target-vocabulary ids, tokens[:, 0] = x_L
    parent: jax.Array  # [B, N] int32 node index of the parent (0 for the root itself)
    depth: jax.Array  # [B, N] int32
    anc: jax.Array  # [B, N, N] bool ancestor-or-self mask
    # sampled drafts only (None otherwise):
    spine: jax.Array | None = None  # [B, N] bool: the node's token was drawn from the draft distribution
    qx: jax.Array | None = None  # [B, N] float32 q(token) of spine nodes (1 elsewhere)
    qd: jax.Array | None = None  # [B, D, Vd] float32 q the spine node at depth d + 1 was drawn from
    q_index: jax.Array | None = None  # [V] int32 each target id's draft-vocabulary index, -1 if none


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Candidates:
    tokens: jax.Array  # [B, M] int32
    scores: jax.Array  # [B, M] float32 product of draft probabilities along the path
    parent: jax.Array  # [B, M] int32 candidate index of the parent, -1 = root
    qx: jax.Array | None = None  # [B, M] sampled drafts: q(token) of spine candidates (1 elsewhere)
    spine: jax.Array | None = None  # [B, M] bool sampled drafts: the candidate was drawn
    qd: jax.Array | None = None  # [B, D, Vd] sampled drafts: the q of the spine draw at each step


def grow(
    root_probs,
    root_hidden,
    to_target,
    step_fn: Callable,
    num_steps: int,
    topk: int,
    root_in_region: bool,
    mask_fn: Callable | None = None,
    draw: Callable | None = None,
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
    draw(probs [B, Vd], j, (max [B], argmax [B]) of probs) -> (ids [B], w [B, Vd], rows [B] bool):
        sampled drafts, q = w / sum(w) (normalised here, every step at once). In the rows that
        sample, the first child of the spine (the root, then each spine child) is ids, drawn from
        q at draft step j, and its siblings are the k - 1 most likely other tokens; the spine
        child is always a beam (slot 0) and always kept by rerank, so that whether it is in the
        tree never depends on its value. A forced token is a spine child with q(child) = 1 and
        q = 0 (its draw was certain).
    """
    b = root_probs.shape[0]
    k = topk
    spine_l: list = []
    drawn_l: list = []  # per step: (the drawn id [B], the candidates drawn [B, M_j])
    w_l: list = []  # per step: q unnormalised [B, Vd]

    def children(probs, paths, plen, j):  # probs [B, P, Vd] -> top-k (probabilities, target tokens)
        forced = None
        if mask_fn is not None:
            ok, forced = mask_fn(paths, plen)
            probs = jnp.where(ok, probs, 0.0)
            probs = probs / jnp.maximum(jnp.sum(probs, -1, keepdims=True), 1e-30)
        p, ids = jax.lax.top_k(probs, k)
        first = jnp.arange(k) == 0
        spine = None
        if draw is not None:  # beam 0 of a sampling row is the spine: its first child is drawn
            d_ids, w, rows = draw(probs[:, 0], j, (p[:, 0, 0], ids[:, 0, 0]))  # [B], [B, Vd], [B]
            if k > 1:  # then beam 0's top k without the drawn token (its position m, or k if absent)
                top = ids[:, 0]  # [B, k]
                m = first_true(jnp.concatenate([top == d_ids[:, None], jnp.ones((b, 1), bool)], -1))
                rest = jnp.where(jnp.arange(k - 1) < m[:, None], top[:, :-1], top[:, 1:])
                s_ids = jnp.concatenate([d_ids[:, None], rest], -1)  # [B, k]
            else:
                s_ids = d_ids[:, None]
            s_p = jnp.take_along_axis(probs[:, 0], s_ids, -1)
            is_s = rows[:, None, None] & (jnp.arange(ids.shape[1]) == 0)[None, :, None]  # [B, P, 1]
            ids = jnp.where(is_s, s_ids[:, None], ids)
            p = jnp.where(is_s, s_p[:, None], p)
            spine = is_s & first
        tok = to_target(ids).astype(jnp.int32)
        if forced is not None:  # forced first; a sibling that already held it takes the old first
            is_f, f = forced[..., None] >= 0, forced[..., None]
            moved = jnp.where(first, f, jnp.where(tok == f, tok[..., :1], tok))
            tok = jnp.where(is_f, moved, tok)
            p = jnp.where(is_f, first.astype(p.dtype), p)
            if draw is not None:
                w = jnp.where(spine[:, 0, :1] & is_f[:, 0], 0.0, w)
        if draw is not None:
            spine_l.append(spine.reshape(b, -1))
            # q(child) of a drawn spine child; a forced one's is 1 (its draw was certain), as elsewhere
            drawn = spine if forced is None else spine & ~is_f
            drawn_l.append((d_ids, drawn.reshape(b, -1)))
            w_l.append(w)
        return p, tok

    r = int(root_in_region)
    w = max(r + (num_steps - 1) * k, 1)
    p0, tok0 = children(root_probs[:, None], jnp.zeros((b, 1, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32), 0)
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
        p, tok = children(probs, beam_path, jnp.full((b, k), j, jnp.int32), j)  # [B, k(beam), k(child)]
        child_score = (beam_score[:, :, None] * p).reshape(b, k * k)
        child_tok = tok.reshape(b, k * k)
        toks.append(child_tok)
        scores.append(child_score)
        parents.append(jnp.repeat(beam_cand, k, axis=1))
        if j == num_steps - 1:
            break
        key = child_score if draw is None else jnp.where(spine_l[-1], 2.0, child_score)  # the spine stays beam 0
        _, pick = jax.lax.top_k(key, k)  # best k of k*k become the next beams
        beam_score = jnp.take_along_axis(child_score, pick, axis=1)
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
    cand = Candidates(jnp.concatenate(toks, 1), jnp.concatenate(scores, 1), jnp.concatenate(parents, 1))
    if draw is None:
        return cand
    qd = normalised(jnp.stack(w_l, 1))  # [B, D, Vd] every step's q at once
    qx = [jnp.where(at, jnp.take_along_axis(qd[:, j], d_ids[:, None], 1), 1.0) for j, (d_ids, at) in enumerate(drawn_l)]
    return dataclasses.replace(cand, qx=jnp.concatenate(qx, 1), spine=jnp.concatenate(spine_l, 1), qd=qd)


def normalised(w):
    """w [..., V] >= 0 -> w / sum(w) over V (0 where a row has nothing)."""
    return w / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1e-30)


def rerank(root_tokens, cand: Candidates, num_draft_tokens: int, num_steps: int, q_index=None) -> Tree:
    """Keeps the best N - 1 candidates (ties go to the earlier one, so parents beat children); with
    sampled drafts the spine first, shallowest first. q_index [V]: target_index's map, kept in the
    tree with sampled drafts."""
    b = root_tokens.shape[0]
    n = num_draft_tokens
    key = cand.scores
    if cand.spine is not None:  # candidate j's depth is j's step + 1; spine keys 2 - 0.01 * depth
        m = cand.scores.shape[1]
        k = _topk_of(m, num_steps)
        depth = jnp.asarray([1] * k + [d for d in range(2, num_steps + 1) for _ in range(k * k)])
        key = jnp.where(cand.spine, 2.0 - 0.01 * depth, cand.scores)
    _, sel = jax.lax.top_k(key, n - 1)
    sel = jnp.sort(sel, axis=1)  # candidate order: parents before children
    tokens = jnp.concatenate([root_tokens[:, None], jnp.take_along_axis(cand.tokens, sel, 1)], 1)
    pc = jnp.take_along_axis(cand.parent, sel, 1)  # [B, N-1] parent candidate index or -1
    match = sel[:, None, :] == pc[:, :, None]  # [B, N-1, N-1]
    parent = jnp.where(any_of(match), first_true(match) + 1, 0).astype(jnp.int32)
    parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent], 1)
    tree = build_tree(tokens, parent, num_steps)
    if cand.qx is None or cand.spine is None or cand.qd is None:
        return tree
    qx = jnp.concatenate([jnp.ones((b, 1), jnp.float32), jnp.take_along_axis(cand.qx, sel, 1)], 1)
    spine = jnp.concatenate([jnp.zeros((b, 1), bool), jnp.take_along_axis(cand.spine, sel, 1)], 1)
    return dataclasses.replace(tree, qx=qx, spine=spine, qd=cand.qd, q_index=q_index)


def target_index(q_ids, vocab_size: int):
    """q_ids [Vd] the draft vocabulary's target ids -> [V] int32: each target id's draft index,
    -1 where the draft vocabulary lacks it (verification reads q on the target vocabulary through
    it: a gather that fuses into its use, where scattering q there costs kernels of its own)."""
    vd = q_ids.shape[0]
    return jnp.full((vocab_size,), -1, jnp.int32).at[q_ids].set(jnp.arange(vd, dtype=jnp.int32))


def _topk_of(m: int, num_steps: int) -> int:
    """topk k from the candidate count m = k + (num_steps - 1) * k^2."""
    return next(k for k in range(1, m + 1) if k + (num_steps - 1) * k * k == m)


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

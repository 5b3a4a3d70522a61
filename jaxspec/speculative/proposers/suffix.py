"""Text-match candidates merged into a draft model's tree (--speculative-suffix-draft-tokens).

Much of what an engine is asked to write repeats text it has seen: code it was given to edit,
passages an answer quotes, the same tool-call JSON every turn of an agent loop, a previous answer
being refined. There a draft that copies accepts many tokens a round at no model cost, while a
draft model proposes a few tokens a round everywhere. Here both propose, and one target forward
verifies the union:

  the draft model's tree   [B, N]: N = num_draft_tokens, built as without this option;
  the text-match tree      [B, M + 1]: the longest earlier matches of the request's latest tokens
                           in its own text (prompt and output so far) and in earlier requests'
                           (the engine's shared corpus), with their most frequent continuations
                           first, M = suffix_nodes; NGRAM's matcher (ngram.py) with
                           match_type PROB and matches of at least --speculative-suffix-min-match
                           tokens. Where nothing matches that long, its nodes are padding;
  the merged tree          [B, N + M]: the draft's nodes, then the match tree's below the same root.
                           A match node whose path the draft's tree already holds becomes padding
                           (its own parent, which no walk reaches) and its children hang below
                           the draft's node instead, so siblings stay distinct tokens, which
                           lossless verification needs. Match candidates are chosen without the
                           target's random numbers, so sampled rounds verify them with the same
                           rules as the draft's deterministic siblings (verify.py): lossless.

The match tree is found first, each round (loop.spec_round): a round where no slot has a match
verifies the draft's tree alone, N rows instead of N + M (the match nodes would all be padding),
since a CPU forward costs in proportion to its rows.

The proposer wraps the draft model's (`with_text_match`): its cache is the draft's KV cache plus
the request's text (SuffixCache), and every other call passes through to the wrapped proposer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.speculative.proposers.base import DraftState, Proposer
from jaxspec.speculative.proposers.ngram import SEP, NgramHistory, history_extend, history_prefill, history_tree
from jaxspec.speculative.short_axis import any_of, first_true
from jaxspec.speculative.tree import Tree, build_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SuffixCache:
    kv: Any  # the wrapped draft's cache (a KVCache)
    text: NgramHistory  # the request's tokens so far, x_L last


@dataclasses.dataclass(frozen=True, eq=False)
class TextMatchProposer(Proposer):
    inner: Proposer | None = None

    def __getattr__(self, name: str):  # what the wrapped proposer has beyond the protocol
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _inner(self) -> Proposer:
        assert self.inner is not None
        return self.inner

    def features(self, h, captured):
        return self._inner().features(h, captured)

    def make_cache(self, batch: int, max_len: int, dtype):
        text = NgramHistory(jnp.full((batch, max_len), SEP, jnp.int32), jnp.zeros((batch,), jnp.int32))
        return SuffixCache(self._inner().make_cache(batch, max_len, dtype), text)

    def prefill_chunk(self, dparams, tgt, cache, tokens, feats, start, commit_lens):  # cache: SuffixCache
        # the draft's tokens: the prompt (shifted by one for EAGLE, whose text then lacks the first token)
        kv = self._inner().prefill_chunk(dparams, tgt, cache.kv, tokens, feats, start, commit_lens)
        return SuffixCache(kv, history_prefill(cache.text, tokens, start, commit_lens))

    def extend(self, dparams, tgt, state: DraftState, tokens, feats, n_block, active) -> DraftState:
        cache: SuffixCache = state.cache
        inner = self._inner().extend(
            dparams, tgt, dataclasses.replace(state, cache=cache.kv), tokens, feats, n_block, active
        )
        if self.root_in_region and tokens.shape[1] > 1:
            # a round's block starts with x_L, which the text already ends with (the one token after
            # prefill is the first new one)
            tokens, n_block = tokens[:, 1:], n_block - 1
        text = history_extend(cache.text, tokens, n_block, active)
        return dataclasses.replace(inner, cache=SuffixCache(inner.cache, text))

    def step(self, dparams, tgt, state: DraftState, tokens, hidden, depth: int, mask, offset):
        cache: SuffixCache = state.cache
        inner = dataclasses.replace(state, cache=cache.kv)
        probs, h, inner = self._inner().step(dparams, tgt, inner, tokens, hidden, depth, mask, offset)
        return probs, h, dataclasses.replace(inner, cache=SuffixCache(inner.cache, cache.text))

    def to_target(self, dparams, ids):
        return self._inner().to_target(dparams, ids)

    def text_tree(self, dparams, state: DraftState, last, spec) -> Tree:
        """The text-match tree [B, suffix_nodes + 1] below x_L = last [B]."""
        return history_tree(dparams["corpus"], state.cache.text, last, spec.suffix, spec.suffix_nodes + 1)


def with_text_match(prop: Proposer) -> TextMatchProposer:
    """`prop` proposing text-match candidates too (its draft params then need a "corpus": ngram.Corpus)."""
    fields = {f.name: getattr(prop, f.name) for f in dataclasses.fields(Proposer)}
    return TextMatchProposer(**fields, inner=prop)


def merge_trees(draft: Tree, match: Tree, depth: int) -> Tree:
    """draft [B, N] (the draft model's tree) and match [B, M + 1] (same root; padding nodes are their own
    parents) -> one tree [B, N + M] of depth at most `depth`: the draft's nodes first, then the
    match tree's below the root, a match node that repeats a draft node's path made padding with its
    children moved below the draft node. Sampled drafts' fields (spine, qx, qd) carry over; the
    match nodes are off the spine (qx 1)."""
    b, n = draft.tokens.shape
    m = match.tokens.shape[1] - 1
    node = jnp.arange(n)
    where = [jnp.zeros((b,), jnp.int32)]  # match node i -> its node in the merged tree (root: 0)
    parents = []
    for i in range(1, m + 1):
        p = match.parent[:, i]
        pad = p == i
        par = jnp.take_along_axis(jnp.stack(where, 1), jnp.minimum(p, i - 1)[:, None], 1)[:, 0]
        tok = match.tokens[:, i]
        # the draft's child of par with this token (par a draft node: below n)
        hit = (draft.parent == par[:, None]) & (node > 0) & (draft.tokens == tok[:, None]) & (par < n)[:, None]
        dup = any_of(hit) & ~pad
        own = jnp.full((b,), n + i - 1, jnp.int32)
        where.append(jnp.where(dup, first_true(hit), own))
        parents.append(jnp.where(pad | dup, own, par))
    tokens = jnp.concatenate([draft.tokens, match.tokens[:, 1:]], 1)
    parent = jnp.concatenate([draft.parent, jnp.stack(parents, 1).astype(jnp.int32)], 1)
    tree = build_tree(tokens, parent, depth)
    if draft.spine is None or draft.qx is None:
        return tree
    spine = jnp.concatenate([draft.spine, jnp.zeros((b, m), bool)], 1)
    qx = jnp.concatenate([draft.qx, jnp.ones((b, m), draft.qx.dtype)], 1)
    return dataclasses.replace(tree, spine=spine, qx=qx, qd=draft.qd, q_index=draft.q_index)

"""NGRAM drafting: draft trees from n-gram matches, built on the device inside the compiled round.

Where the n-gram "cache" lives. SGLang keeps one host-side trie (C++) that every request feeds and
queries between rounds. Here the match runs on the device, so a round stays one compiled program
with no host round trip:

  text   per slot: `NgramHistory.tokens` [B, S], the request's prompt and every emitted token
         (x_L last), appended in place by `extend` after each round;
         shared: `dparams["corpus"]` [C], earlier requests' prompts + outputs separated by -1,
         kept by the engine within `speculative_ngram_capacity` tokens, oldest dropped first.
  match  the suffix ending at x_L is compared with every earlier position of [corpus, -1, history]
         (max_match_window_size shifted compares); positions whose match length is at least
         min_match_window_size are occurrences. The K best occurrences (longest match, then most
         recent) give continuations of up to branch_length - 1 tokens.
  tree   the continuations form a trie (shared prefixes merged); a node's count is how many
         occurrences run through it. BFS (SGLang's rule) keeps, below each node, its first `breadth`
         children by their best occurrence (longest match, then most recent), breadth =
         (max_w - w) * scale + min_bfs for the longest match w, one `scale` less per level (at
         least 1), scale = (max_bfs - min_bfs) / (max_w - min_w + 1), and takes nodes level by level;
         PROB takes the most frequent nodes first (count / K = the product along the path of each
         child's share of its parent's occurrences). Both stop at N - 1 nodes; unused slots are
         padding nodes that nothing can accept. Unlike SGLang, occurrences of every window length
         share one tree built with the longest match's breadth.

Shapes: K = NGRAM_OCCURRENCES occurrences, D = min(N - 1, branch_length - 1) continuation depth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compile_target
from jaxspec.speculative.proposers.base import DraftState, Proposer
from jaxspec.speculative.tree import Tree, build_tree

NGRAM_OCCURRENCES = 32  # K: occurrences merged into one tree
SEP = -1  # separator / empty entry (never equals a token)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramHistory:
    tokens: jax.Array  # [B, S] int32, SEP past `lengths`
    lengths: jax.Array  # [B] int32 tokens held (x_L is tokens[lengths - 1] once decoding starts)

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]


def match_occurrences(seq, end, suffix, min_w: int, k: int):
    """seq [B, T] (SEP-padded text to search), end [B]: occurrences must end before seq index end - 1
    (so that a continuation exists and the suffix does not match itself); suffix [B, W] with
    suffix[:, 0] = the last token, suffix[:, i] = the token i places earlier (SEP where none).

    Returns (pos [B, K] index of each occurrence's last matched token, mlen [B, K] match length,
    0 for no occurrence), best first: longest match, then most recent."""
    b, t = seq.shape
    w = suffix.shape[1]
    j = jnp.arange(t)[None, :]
    run = jnp.ones((b, t), bool)
    mlen = jnp.zeros((b, t), jnp.int32)
    for i in range(w):  # run of matches ending at j: seq[j - i] == suffix[i] for i = 0 .. len-1
        shifted = jnp.pad(seq, ((0, 0), (i, 0)), constant_values=SEP)[:, :t]  # seq[j - i]
        run = run & (shifted == suffix[:, i : i + 1]) & (suffix[:, i : i + 1] != SEP)
        mlen = mlen + run
    ok = (mlen >= min_w) & (j < end[:, None] - 1)
    score = jnp.where(ok, mlen * t + j, -1)
    top, pos = top_k(score, k)
    return pos.astype(jnp.int32), jnp.where(top >= 0, top // t, 0).astype(jnp.int32)


TOP_K_BLOCK = 32  # top_k's CPU form: entries per block


def top_k(x, k: int):
    """jax.lax.top_k(x, k) over x [B, T] of distinct entries (or -1, never chosen before the
    others): (values [B, k], indices [B, k]). XLA:CPU sorts the whole row for a top_k (6.7 ms for
    18k entries on a 2-core AMD EPYC, a round's largest cost with text matching); on CPU it takes
    the k blocks of TOP_K_BLOCK entries with the largest maxima first (the k largest entries lie
    in them: an entry with i larger ones has at most i blocks' maxima above its own block's) and
    the k largest of those 32 k entries (0.54 ms)."""
    b, t = x.shape
    g = -(-t // TOP_K_BLOCK)
    if compile_target.platform() != "cpu" or g <= k:
        return jax.lax.top_k(x, k)
    blocks = jnp.pad(x, ((0, 0), (0, g * TOP_K_BLOCK - t)), constant_values=-1).reshape(b, g, TOP_K_BLOCK)
    _, best = jax.lax.top_k(jnp.max(blocks, -1), k)  # [B, k]
    cand = jnp.take_along_axis(blocks, best[:, :, None], 1).reshape(b, k * TOP_K_BLOCK)
    idx = (best[:, :, None] * TOP_K_BLOCK + jnp.arange(TOP_K_BLOCK)[None, None, :]).reshape(b, -1)
    top, j = jax.lax.top_k(cand, k)
    return top, jnp.minimum(jnp.take_along_axis(idx, j, 1), t - 1)


def continuation_trie(seq, end, pos, mlen, depth: int):
    """Continuations of the occurrences and the trie they form.

    Returns cont [B, K, D] tokens, valid [B, K, D], rep [B, K, D] (the first occurrence sharing the
    prefix cont[c, :d + 1]; a node is unique where rep == c) and count [B, K, D] (occurrences through
    that prefix)."""
    b, t = seq.shape
    idx = pos[:, :, None] + 1 + jnp.arange(depth)[None, None, :]  # [B, K, D]
    cont = jnp.take_along_axis(seq[:, None, :], jnp.clip(idx, 0, t - 1), axis=2)
    valid = (mlen[:, :, None] > 0) & (idx < end[:, None, None]) & (cont != SEP)
    valid = jnp.cumprod(valid, axis=2).astype(bool)  # a continuation stops at the first SEP / the end
    eq = (cont[:, :, None, :] == cont[:, None, :, :]) & valid[:, :, None, :] & valid[:, None, :, :]  # [B, K, K, D]
    same = jnp.cumprod(eq, axis=3).astype(bool)  # same prefix up to and including d
    rep = jnp.argmax(same, axis=2).astype(jnp.int32)  # first occurrence with that prefix
    count = same.sum(2).astype(jnp.int32)
    return cont, valid, rep, count


def select_nodes(valid, rep, count, mlen, n_nodes: int, cfg):
    """Chooses up to n_nodes trie nodes, parents before children. Returns (occ [B, M], dep [B, M],
    ok [B, M]) with M = n_nodes: node m is prefix cont[occ, :dep + 1]; ok is False for padding."""
    b, k, d = valid.shape
    c = jnp.arange(k)[None, :, None]
    dd = jnp.arange(d)[None, None, :]
    unique = valid & (rep == c)
    big = k * d + 1
    if cfg.match_type == "PROB":
        # most frequent first; ties: shallower, then the better occurrence (parents precede children)
        key = jnp.where(unique, count * big * big - dd * big - c, -1)
    else:
        # SGLang's rule: breadth (max_w - w) * scale + min_bfs at the top for a w-token match, one
        # `scale` less per level (at least 1), scale = (max_bfs - min_bfs) / (max_w - min_w + 1).
        lo, hi = cfg.min_match_window_size, cfg.max_match_window_size
        scale = (cfg.max_bfs_breadth - cfg.min_bfs_breadth) / (hi - lo + 1)
        best = mlen[:, 0]  # [B] the longest match
        breadth = (hi - best)[:, None, None] * scale + cfg.min_bfs_breadth - dd * scale  # [B, 1, D]
        breadth = jnp.maximum(jnp.floor(breadth), 1).astype(jnp.int32)
        # rank among siblings (unique nodes at the same depth under the same parent prefix), by their
        # best occurrence: longest match, then most recent (SGLang: longest anchor first, children by recency)
        parent_rep = jnp.concatenate([jnp.zeros((b, k, 1), jnp.int32), rep[:, :, :-1]], 2)  # [B, K, D]
        sib = unique[:, None, :, :] & (parent_rep[:, None, :, :] == parent_rep[:, :, None, :])  # [B, K(c), K(c''), D]
        rank = (sib & (c[:, None, :, :] < c[:, :, None, :])).sum(2)  # [B, K, D]
        kept = unique & (rank < breadth)
        alive = _prefix_alive(kept, parent_rep)  # a node survives only if its whole prefix does
        key = jnp.where(alive, (d - dd) * big - c, -1)  # level by level, better occurrences first
    top, flat = jax.lax.top_k(key.reshape(b, k * d), n_nodes)
    ok = top >= 0
    occ, dep = flat // d, flat % d
    # order parents before children (level order), keeping each level's order
    order = jnp.argsort(jnp.where(ok, dep, d) * (k * d) + jnp.arange(n_nodes)[None, :], axis=1)
    take = lambda x: jnp.take_along_axis(x, order, 1)
    return take(occ).astype(jnp.int32), take(dep).astype(jnp.int32), take(ok)


def _prefix_alive(kept, parent_rep):
    """kept [B, K, D] -> alive: kept and every ancestor prefix (via parent_rep) is kept."""
    b, k, d = kept.shape
    alive = [kept[:, :, 0]]
    for i in range(1, d):
        parent_alive = jnp.take_along_axis(alive[i - 1], parent_rep[:, :, i], axis=1)
        alive.append(kept[:, :, i] & parent_alive)
    return jnp.stack(alive, 2)


def ngram_tree(seq, end, last, cfg, n: int) -> Tree:
    """seq [B, T] text to search (x_L at index end - 1), last [B] = x_L -> a Tree of n nodes."""
    b, t = seq.shape
    w = cfg.max_match_window_size
    d = max(1, min(n - 1, cfg.branch_length - 1))
    back = end[:, None] - 1 - jnp.arange(w)[None, :]
    suffix = jnp.where(back >= 0, jnp.take_along_axis(seq, jnp.clip(back, 0, t - 1), 1), SEP)
    pos, mlen = match_occurrences(seq, end, suffix, cfg.min_match_window_size, min(NGRAM_OCCURRENCES, t))
    cont, valid, rep, count = continuation_trie(seq, end, pos, mlen, d)
    occ, dep, ok = select_nodes(valid, rep, count, mlen, n - 1, cfg)
    tok = jnp.take_along_axis(cont.reshape(b, -1), occ * d + dep, 1)
    # parent: the node holding prefix cont[rep[occ, dep - 1], :dep]
    prep = jnp.take_along_axis(rep.reshape(b, -1), occ * d + jnp.maximum(dep - 1, 0), 1)
    want = prep * d + dep - 1  # flat id of the parent node
    have = jnp.where(ok, occ * d + dep, -2)  # flat id of each selected node
    match = (have[:, None, :] == want[:, :, None]) & (dep[:, :, None] > 0)
    idx = jnp.arange(1, n)[None, :]
    parent = jnp.where(jnp.any(match, -1), jnp.argmax(match, -1) + 1, 0)
    parent = jnp.where(ok, parent, idx)  # padding: its own parent, so no walk ever reaches it
    tokens = jnp.concatenate([last[:, None], jnp.where(ok, tok, 0)], 1)
    parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent.astype(jnp.int32)], 1)
    return build_tree(tokens, parent, d)


@dataclasses.dataclass(frozen=True, eq=False)
class NgramProposer(Proposer):
    ngram: object = None  # NgramConfig

    def make_cache(self, batch: int, max_len: int, dtype):
        return NgramHistory(jnp.full((batch, max_len), SEP, jnp.int32), jnp.zeros((batch,), jnp.int32))

    def prefill_chunk(self, dparams, tgt, cache, tokens, feats, start, commit_lens):
        return history_prefill(cache, tokens, start, commit_lens)

    def extend(self, dparams, tgt, state, tokens, feats, n_block, active):
        return dataclasses.replace(state, cache=history_extend(state.cache, tokens, n_block, active))

    def propose_tree(self, dparams, state: DraftState, last, spec) -> Tree:
        return history_tree(dparams["corpus"], state.cache, last, self.ngram, spec.num_draft_tokens)


def history_prefill(h: NgramHistory, tokens, start, commit_lens) -> NgramHistory:
    """A prompt chunk tokens [B, C] written at columns start + c; afterwards lengths = commit_lens
    (at most start + C)."""
    b, c = tokens.shape
    col = start + jnp.arange(c)[None, :]
    keep = col < commit_lens[:, None]
    buf = jax.lax.dynamic_update_slice(h.tokens, jnp.where(keep, tokens, SEP), (0, start))
    return NgramHistory(buf, jnp.clip(commit_lens, 0, start + c).astype(jnp.int32))


def history_extend(h: NgramHistory, tokens, n_block, active) -> NgramHistory:
    """Appends tokens[:, :n_block] [B, T] to the active slots' text."""
    b, t = tokens.shape
    i = jnp.arange(t)[None, :]
    # columns out of range are dropped
    cols = jnp.where((i < n_block[:, None]) & active[:, None], h.lengths[:, None] + i, h.max_len)
    buf = h.tokens.at[jnp.arange(b)[:, None], cols].set(tokens, mode="drop")
    lengths = jnp.minimum(h.lengths + jnp.where(active, n_block, 0), h.max_len)
    return NgramHistory(buf, lengths.astype(jnp.int32))


def history_tree(corpus, h: NgramHistory, last, cfg, n: int) -> Tree:
    """The tree of n nodes that matches of the slots' text (x_L last) in [corpus [C], SEP, text] propose."""
    b = h.tokens.shape[0]
    seq = jnp.concatenate(
        [jnp.broadcast_to(corpus[None, :], (b, corpus.shape[0])), jnp.full((b, 1), SEP, jnp.int32), h.tokens], 1
    )
    return ngram_tree(seq, h.lengths + corpus.shape[0] + 1, last, cfg, n)


class Corpus:
    """The shared n-gram text: finished requests' tokens, newest last, at most `capacity` tokens.
    `device()` pads it to a power-of-two length of at least `reserve` (SEP-filled in front) so that
    few shapes compile."""

    def __init__(self, capacity: int, reserve: int = 4096):
        self.capacity = capacity
        self.reserve = reserve
        self.buf = np.zeros((0,), np.int32)

    def add(self, seqs) -> None:
        parts = [self.buf] + [np.append(np.asarray(s, np.int32), SEP) for s in seqs]
        self.buf = np.concatenate(parts)[-self.capacity :]

    def device_size(self) -> int:
        """Tokens of the device copy: a power of two, at least `reserve`."""
        return max(self.reserve, 1 << int(np.ceil(np.log2(max(len(self.buf), 1)))))

    def device(self):
        n = self.device_size()
        out = np.full((n,), SEP, np.int32)
        if len(self.buf):
            out[n - len(self.buf) :] = self.buf
        return jnp.asarray(out)


def load_ngram(spec, target):
    prop = NgramProposer(
        graphdef=None,
        cfg=target.cfg,
        root_in_region=False,
        shift=0,
        draft_vocab=1,
        capture_layers=(),
        uses_hidden=False,
        builds_tree=True,
        ngram=spec.ngram,
    )
    return prop, {"corpus": Corpus(spec.ngram.capacity).device()}

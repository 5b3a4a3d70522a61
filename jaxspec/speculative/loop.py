"""The speculative round and the `lax.while_loop` that runs rounds until every slot finishes.

One round (all static shapes; B slots, N tree nodes, D = spec.depth: num_steps, or deeper
text-match candidates merged into the tree in rounds where some slot has a match, proposers/suffix.py):
  draft   proposer steps grow a tree from the root distribution (tree.grow + tree.rerank)
  verify  the target runs over the N tree tokens with the ancestor mask; verify.verify accepts
  commit  the accepted path's target KV moves to contiguous columns; lengths += accepted + 1
  emit    accepted drafts + bonus are appended (cut at a stop token or max_new_tokens)
  refresh the proposer extends its KV over the accepted tokens and gets the next root
Slots that finished keep running rounds as padding (their lengths do not move) until all are done.

`spec_start` samples the first token and starts the draft; `spec_block` runs rounds of one tree
shape (or plain steps: speculation off) on that state (the jitted `start_state` and `run_block`).
With adaptive speculation the offline engine runs blocks of a few rounds with the shape chosen
between them (speculative/adaptive.py); without it, `spec_run`: both in one program, every round
until every request is done.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.attention import with_mode
from jaxspec.cache import KVCache
from jaxspec.config import SpecConfig
from jaxspec.decode import LENGTH, RUNNING, STOPPED, target_prefill
from jaxspec.grammar import Emitted, allowed, mask_logits
from jaxspec.logprobs import TokenLogprobs, compute
from jaxspec.sampling import GREEDY_EPS, SamplingTensors, argmax, draw_noised, noise, sample
from jaxspec.speculative import tree as tree_lib
from jaxspec.speculative.proposers.base import DraftState, Proposer
from jaxspec.speculative.proposers.suffix import TextMatchProposer, merge_trees
from jaxspec.speculative.short_axis import any_of, first_true
from jaxspec.speculative.verify import Accepted, greedy_verify, verify
from jaxspec.weights import Models


def prefill_step(
    tgt,
    prop: Proposer,
    dparams,
    cache: KVCache,
    dcache,
    tokens,
    dtokens,
    start,
    prompt_lens,
    last_h,
    last_feat,
    backend="xla",
):
    """Target and draft prefill of one chunk (the body of `spec_prefill_chunk`, also used by the
    server on slot views). Returns (cache, dcache, last_h, last_feat)."""
    h, cap, cache, keep = target_prefill(tgt, cache, tokens, start, prompt_lens, prop.capture_layers, backend)
    feats = prop.features(h, cap)
    last_h = keep(h, last_h)
    if feats is not None:
        last_feat = keep(feats, last_feat)
    dcache = prop.prefill_chunk(dparams, tgt, dcache, dtokens, feats, start, prompt_lens - prop.shift)
    return cache, dcache, last_h, last_feat


@functools.partial(jax.jit, donate_argnames=("cache", "dcache"))
def spec_prefill_chunk(
    models: Models, cache: KVCache, dcache: KVCache, tokens, dtokens, start, prompt_lens, last_h, last_feat
):
    """Target and draft prefill of one chunk. tokens: prompt [B, C]; dtokens: the draft's tokens for
    the same entries (prompt shifted by `prop.shift`). last_h [B, H] / last_feat [B, F]: the target
    hidden and draft feature of each slot's last prompt token (updated when it is in this chunk)."""
    tgt, prop = models.target(), models.draft
    args = (tokens, dtokens, start, prompt_lens, last_h, last_feat)
    return prefill_step(tgt, prop, models.dparams, cache, dcache, *args, models.backend)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    out: jax.Array  # [B, M] int32
    num_out: jax.Array  # [B]
    done: jax.Array  # [B] bool
    finish: jax.Array  # [B] int32
    last: jax.Array  # [B] x_L: last emitted token, no target KV yet
    cache: KVCache
    draft: DraftState
    verify_ct: jax.Array  # [B] rounds run while the slot was active
    hist: jax.Array  # [B, D + 2] histogram of tokens emitted per round (1 .. D + 1)
    # server only (jaxspec/serving.py); None in generate():
    base: jax.Array | None = None  # [B] `out` is a window holding tokens base .. num_out - 1
    counts: jax.Array | None = None  # [B, V] int32 output-token counts (penalties of plain slots)
    seen: jax.Array | None = None  # [B, V] bool prompt + output tokens
    lps: TokenLogprobs | None = None  # [B, M(, K)] logprobs of `out`'s tokens (when requested)


def emit(state: SpecState, new, n_new, max_new_tokens, stop_ids, logits=None, st=None):
    """Appends new[:, :n_new] (cut after the first stop token and at max_new_tokens) to active slots.
    logits [B, T, V]: the target's logits that produced each new token, for state.lps (when the
    state carries logprobs; st: the sampling tensors, for the temperature)."""
    b, t = new.shape
    i = jnp.arange(t)[None, :]
    active = ~state.done
    is_stop = (i < n_new[:, None]) & jnp.any(new[:, :, None] == stop_ids[:, None, :], -1)
    has_stop = any_of(is_stop)
    count = jnp.where(has_stop, first_true(is_stop) + 1, n_new)
    room = max_new_tokens - state.num_out
    stopped = has_stop & (count <= room)
    count = jnp.where(active, jnp.minimum(count, room), 0)
    start = state.num_out if state.base is None else state.num_out - state.base
    cols = jnp.where(i < count[:, None], start[:, None] + i, state.out.shape[1])  # out of range = dropped
    out = state.out.at[jnp.arange(b)[:, None], cols].set(new, mode="drop")
    lps = state.lps
    if lps is not None:
        assert logits is not None and st is not None, "a state with logprobs needs the logits of its tokens"
        lps = lps.scatter(jnp.arange(b)[:, None], cols, compute(logits, new, st.temperature, lps.k))
    num_out = state.num_out + count
    hit_len = active & ~stopped & (num_out >= max_new_tokens)
    stopped &= active
    finish = jnp.where(stopped, STOPPED, jnp.where(hit_len, LENGTH, state.finish))
    counts, seen = state.counts, state.seen
    if counts is not None:
        assert seen is not None
        emitted = (i < count[:, None]).astype(jnp.int32)
        counts = counts.at[jnp.arange(b)[:, None], new].add(emitted)
        seen = seen.at[jnp.arange(b)[:, None], new].max(emitted > 0)
    return dataclasses.replace(
        state,
        out=out,
        num_out=num_out,
        done=state.done | stopped | hit_len,
        finish=finish,
        counts=counts,
        seen=seen,
        lps=lps,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundConstants:
    """What every round of a loop reads unchanged, made once before the loop (work in a loop's
    body runs every round; XLA does not hoist all of it): the acceptance thresholds [B], the rows'
    key stream for rounds [B] (round_keys) and, with sampled drafts, each target id's
    draft-vocabulary index [V] (tree.Tree.q_index)."""

    thr_single: jax.Array
    thr_acc: jax.Array
    stream: jax.Array
    q_index: jax.Array | None = None


def round_constants(
    tgt, prop: Proposer, dparams, spec: SpecConfig, st: SamplingTensors, sampled: bool | str
) -> RoundConstants:
    """The RoundConstants of st's rows under the tree shape `spec`."""
    b = st.temperature.shape[0]
    q_index = None
    if draws_drafts(prop, spec, sampled):
        ids = prop.to_target(dparams, jnp.arange(prop.draft_vocab, dtype=jnp.int32)).astype(jnp.int32)
        q_index = tree_lib.target_index(ids, tgt.cfg.vocab_size)
    return RoundConstants(
        jnp.full((b,), spec.accept_threshold_single, jnp.float32),
        jnp.full((b,), spec.accept_threshold_acc, jnp.float32),
        jax.vmap(jax.random.fold_in)(st.keys, jnp.ones((b,), jnp.uint32)),
        q_index,
    )


KEY_STRIDE = 64  # round_keys' data per round: a round takes at most this many keys


def round_keys(consts: RoundConstants, state: SpecState, n: int):
    """[n, B] typed PRNG keys for one round of every row, made at once (one kernel on a GPU,
    where a chain of derivations per use took several): row j < num_steps for the draft's draw at
    depth j + 1, then the verification's coins and its bonus (verify.sample_verify). Key j of
    round r is the row's round stream (RoundConstants) folded with r * KEY_STRIDE + j: distinct
    over every round and tree shape of a request."""
    assert n <= KEY_STRIDE, n
    data = state.verify_ct.astype(jnp.uint32)[None, :] * KEY_STRIDE + jnp.arange(n, dtype=jnp.uint32)[:, None]
    return jax.vmap(jax.vmap(jax.random.fold_in), (None, 0))(consts.stream, data)


def draft_tree(
    prop: Proposer,
    dparams,
    tgt,
    spec: SpecConfig,
    state: SpecState,
    st=None,
    sampled: bool | str = False,
    keys=None,
    q_index=None,
    text=None,
):
    """The round's tree. st: the sampling tensors (its grammar, None: unconstrained: the draft
    then proposes only tokens each node's grammar state allows; its temperatures, for sampled
    drafts). sampled (static): whether any row samples; with spec.draft_sampling the sampling rows
    then draw one path of drafts (the spine, tree.py) from the draft distribution at the row's
    temperature (verify.py accepts those by min(1, p / q)), with keys [>= num_steps, B]
    (round_keys: row j for depth j + 1) and q_index (RoundConstants; made here when None).
    text: the text-match tree [B, suffix_nodes + 1] when spec merges one (spec_round finds it)."""
    if prop.builds_tree:
        return prop.propose_tree(dparams, state.draft, state.last, spec), state.draft
    d = {"state": state.draft}
    grammar = None if st is None else st.grammar

    def step_fn(tokens, hidden, depth, mask, offset):
        probs, h, d["state"] = prop.step(dparams, tgt, d["state"], tokens, hidden, depth, mask, offset)
        return probs, h

    root_hidden = state.draft.root_hidden if prop.uses_hidden else None
    mask_fn = None
    ids = None
    sample_drafts = draws_drafts(prop, spec, sampled)
    if grammar is not None or sample_drafts:
        ids = prop.to_target(dparams, jnp.arange(prop.draft_vocab, dtype=jnp.int32)).astype(jnp.int32)
    if grammar is not None:
        vocab = tgt.cfg.vocab_size
        mask_fn = lambda paths, plen: allowed(grammar, state, paths, plen, vocab, ids, invalid_allows=False)
    draw = None
    if sample_drafts:
        assert st is not None and keys is not None
        # each depth's random numbers made where they are used: a GPU fuses them into the draw
        draw = lambda probs, j, top: draw_drafts(probs, st.temperature, noise(keys[j], prop.draft_vocab), top)
    cand = tree_lib.grow(
        state.draft.root_probs,
        root_hidden,
        lambda ids: prop.to_target(dparams, ids),
        step_fn,
        spec.num_steps,
        spec.eagle_topk,
        prop.root_in_region,
        mask_fn,
        draw,
    )
    if draw is not None and q_index is None:
        q_index = tree_lib.target_index(ids, tgt.cfg.vocab_size)
    tree = tree_lib.rerank(state.last, cand, spec.num_draft_tokens, spec.num_steps, q_index if draw else None)
    if spec.suffix is not None:  # text-match candidates in the same tree (proposers/suffix.py)
        assert text is not None
        tree = merge_trees(tree, text, spec.depth)
    return tree, d["state"]


def draws_drafts(prop: Proposer, spec: SpecConfig, sampled: bool | str) -> bool:
    """Whether sampling rows draw a spine of drafts from the draft distribution (static)."""
    return bool(sampled) and spec.draft_sampling and not prop.builds_tree


def draw_drafts(probs, temperature, rand, top=None):
    """probs [B, Vd] draft distributions, temperature [B], rand: sampling.noise for the rows ->
    (ids [B], w [B, Vd], rows [B]): w = q unnormalised (tree.normalised makes q), q = probs
    sharpened to the row's temperature (probs^(1/T), renormalised), ids drawn from it; rows: the
    rows that sample (temperature > 0; the others take probs' argmax and q is unused). top: (probs'
    largest entry [B], its index [B]) where the caller has them (a top-k's first), saving two
    reductions over the vocabulary. No sum here: a GPU normalises every depth's w in one kernel."""
    if top is None:
        top = (jnp.max(probs, -1), argmax(probs))
    p_max, greedy = top
    t = jnp.maximum(temperature, GREEDY_EPS)[:, None]
    # probs^(1/T) / p_max^(1/T): the largest entry 1, nothing overflows or vanishes with T
    e = jnp.exp((jnp.log(probs.astype(jnp.float32)) - jnp.log(p_max.astype(jnp.float32))[:, None]) / t)
    # no token left (a grammar allows none of the draft's vocabulary): the token is a certain pick,
    # like a forced one (q = its one-hot), not the NaN of a softmax over nothing
    some = p_max > 0
    w = jnp.where(some[:, None], e, jax.nn.one_hot(greedy, probs.shape[-1], dtype=jnp.float32))
    rows = temperature > GREEDY_EPS
    ids = jnp.where(rows & some, draw_noised(w, rand), greedy)
    return ids, w, rows


def spec_round(
    tgt,
    prop,
    dparams,
    spec: SpecConfig,
    state: SpecState,
    st,
    max_new_tokens,
    stop_ids,
    consts: RoundConstants,
    backend,
    plain=None,
    sampled: bool | str = True,
    text=None,
):
    """One round. consts: round_constants(...), made before the loop. plain: [B] bool or None
    (server): those slots accept no draft and take the target's own sample at the root (with
    penalties), i.e. plain decoding inside the round.
    sampled (static): False when every slot is greedy (no sampler in the program). Every slot runs
    the same program; its only data-dependent branches are the sampler's skips of work no slot
    needs, on CPU only (jaxspec/sampling.py SKIP_UNUSED), and, with text-match candidates, the
    choice between the merged tree and the draft's tree alone (below). text: the text-match tree
    [B, suffix_nodes + 1], found by that choice (None: find it)."""
    if spec.suffix is not None and text is None:
        # Text-match candidates are found first. Only a round where some slot has one verifies the
        # merged tree; the others verify the draft's tree alone. Nothing is lost: where no slot has a
        # match the match nodes are all padding, which nothing accepts. But a CPU target forward
        # costs in proportion to the rows it verifies, so the merged tree's extra rows are paid only
        # where they can be accepted. The choice is the batch's (one program, static shapes): one
        # slot's match makes every slot's round the merged one.
        assert isinstance(prop, TextMatchProposer)
        found_text = prop.text_tree(dparams, state.draft, state.last, spec)
        real = found_text.parent[:, 1:] < jnp.arange(1, spec.suffix_nodes + 1)[None, :]  # padding: own parent
        rest = (st, max_new_tokens, stop_ids, consts, backend, plain, sampled)
        return jax.lax.cond(
            jnp.any(real),
            lambda s: spec_round(tgt, prop, dparams, spec, s, *rest, text=found_text),
            lambda s: spec_round(tgt, prop, dparams, spec.without_text(), s, *rest),
            state,
        )
    steps = spec.depth
    keys = round_keys(consts, state, spec.num_steps + 2)  # [num_steps + 2, B]; a greedy program drops them
    tree, dstate = draft_tree(prop, dparams, tgt, spec, state, st, sampled, keys, consts.q_index, text)
    cache = state.cache
    pos = cache.lengths[:, None] + tree.depth
    h, cache, cap = tgt(
        tree.tokens,
        pos,
        cache,
        local_mask=tree.anc,
        capture_layers=prop.capture_layers,
        backend=with_mode(backend, spec.attention_mode),
    )
    logits = tgt.logits(h)  # [B, N, V]
    if st.grammar is not None:  # each node's logits masked by the grammar state along its path
        logits = mask_logits(logits.astype(jnp.float32), st.grammar, state, *tree_lib.node_paths(tree, steps))
    if spec.ngram is not None and spec.ngram.force_greedy_verify:  # SGLANG_NGRAM_FORCE_GREEDY_VERIFY
        acc = greedy_verify(tree, logits, steps)
    else:
        acc = verify(tree, logits, st, keys[-2:], steps, consts.thr_single, consts.thr_acc, sampled)
    if plain is not None:
        acc = _plain_slots(tgt, h, acc, plain, st, state, keys[-1], sampled)
    active = ~state.done
    n_new = acc.num + 1
    cache = cache.commit_path(acc.path, backend)
    cache = dataclasses.replace(cache, lengths=cache.lengths + jnp.where(active, n_new, 0))
    # emitted tokens: the accepted path after the root, then the bonus
    i = jnp.arange(steps + 1)[None, :]
    path_next = jnp.take_along_axis(tree.tokens, jnp.concatenate([acc.path[:, 1:], acc.path[:, -1:]], 1), 1)
    new = jnp.where(i < acc.num[:, None], path_next, jnp.where(i == acc.num[:, None], acc.bonus[:, None], 0))
    b = new.shape[0]
    hist = state.hist.at[jnp.arange(b), n_new].add(active.astype(jnp.int32))
    state = dataclasses.replace(state, cache=cache, verify_ct=state.verify_ct + active, hist=hist)
    # emitted token i was produced at path node i (its parent; the bonus at the last accepted node)
    path_logits = None if state.lps is None else jnp.take_along_axis(logits, acc.path[:, :, None], 1)
    state = emit(state, new, n_new, max_new_tokens, stop_ids, path_logits, st)
    # refresh the draft over what was accepted
    feats = prop.features(h, cap)
    if prop.root_in_region:  # block = [x_L, accepted drafts..., bonus]
        block, n_block, bfeats = jnp.concatenate([state.last[:, None], new], 1), n_new + 1, None
    else:  # block = (accepted drafts..., bonus) with the target features of their predecessors
        block, n_block = new, n_new
        bfeats = None if feats is None else jnp.take_along_axis(feats, acc.path[:, :, None], 1)
    dstate = prop.extend(dparams, tgt, dstate, block, bfeats, n_block, active)
    return dataclasses.replace(state, draft=dstate, last=jnp.where(active, acc.bonus, state.last))


def _plain_slots(tgt, h, acc: Accepted, plain, st: SamplingTensors, state: SpecState, keys, sampled) -> Accepted:
    """Overrides the verification of `plain` slots: no draft accepted, the bonus sampled from the
    root's logits by the plain sampler (penalties from state.counts / state.seen)."""
    counts = state.counts if state.counts is not None else jnp.zeros(h.shape[:1] + (tgt.cfg.vocab_size,), jnp.int32)
    seen = state.seen if state.seen is not None else counts > 0
    root = mask_logits(tgt.logits(h[:, 0]).astype(jnp.float32), st.grammar, state)
    tok = sample(root, st, counts, seen, keys, sampled)
    return Accepted(
        jnp.where(plain, 0, acc.num), jnp.where(plain[:, None], 0, acc.path), jnp.where(plain, tok, acc.bonus)
    )


def start_state(
    models: Models,
    spec: SpecConfig,
    cache: KVCache,
    dcache: KVCache,
    last_h,
    last_feat,
    st: SamplingTensors,
    max_new_tokens,
    stop_ids,
    buf: int,
    sampled: bool | str = True,
    top_logprobs: int | None = None,
) -> SpecState:
    """The first token from the prefill's last hidden state [B, H] and the draft's extension over
    it: the state `spec_block` runs rounds on (out [B, buf]; hist sized for spec.depth).
    top_logprobs (static): None, or record each token's logprob with this many alternatives."""
    tgt, prop, dparams = models.target(), models.draft, models.dparams
    b = last_h.shape[0]
    v = tgt.cfg.vocab_size
    zeros = jnp.zeros((b, v), jnp.int32)
    first_logits = mask_logits(tgt.logits(last_h), st.grammar, Emitted.none(b, max_new_tokens))
    first = sample(
        first_logits,
        st,
        zeros,
        zeros > 0,
        jax.vmap(jax.random.fold_in)(st.keys, jnp.zeros((b,), jnp.int32)),
        sampled,
    )
    dstate = DraftState(
        dcache,
        jnp.zeros((b, prop.draft_vocab), jnp.float32),
        jnp.zeros((b, prop.cfg.hidden_size if prop.uses_hidden else 1), last_h.dtype),
    )
    state = SpecState(
        out=jnp.zeros((b, buf), jnp.int32),
        num_out=jnp.zeros((b,), jnp.int32),
        done=max_new_tokens <= 0,
        finish=jnp.where(max_new_tokens <= 0, LENGTH, RUNNING).astype(jnp.int32),
        last=first,
        cache=cache,
        draft=dstate,
        verify_ct=jnp.zeros((b,), jnp.int32),
        hist=jnp.zeros((b, spec.depth + 2), jnp.int32),
        lps=None if top_logprobs is None else TokenLogprobs.zeros((b, buf), top_logprobs),
    )
    state = emit(state, first[:, None], jnp.ones((b,), jnp.int32), max_new_tokens, stop_ids, first_logits[:, None], st)
    feats = None if last_feat is None or not prop.uses_hidden else last_feat[:, None]
    dstate = prop.extend(
        dparams, tgt, state.draft, first[:, None], feats, jnp.ones((b,), jnp.int32), jnp.ones((b,), bool)
    )
    return dataclasses.replace(state, draft=dstate)


spec_start = jax.jit(
    start_state, static_argnames=("spec", "buf", "sampled", "top_logprobs"), donate_argnames=("cache", "dcache")
)


def plain_steps(
    tgt,
    prop: Proposer,
    dparams,
    state: SpecState,
    st,
    max_new_tokens,
    stop_ids,
    steps: int,
    backend,
    sampled: bool | str,
    early_exit: bool = True,
):
    """Up to `steps` plain decoding steps on a speculative state (speculation off), then one draft
    extension over the tokens they emitted, so that a later round finds the draft up to date.
    Each step counts as a round that emitted one token. Penalties apply where the state carries
    counts / seen (the server). early_exit: stop once every slot is done (False: all `steps` run,
    finished slots as padding; a loop of known trip count). Returns the state."""
    b = state.last.shape[0]
    first_last = state.last

    def step(c):
        i, s, toks, feats = c
        active = ~s.done
        h, cache, cap = tgt(
            s.last[:, None], s.cache.lengths[:, None], s.cache, capture_layers=prop.capture_layers, backend=backend
        )
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.fold_in)(st.keys, jnp.full((b,), 2)), s.num_out)
        if s.counts is None:
            counts = jnp.zeros((b, tgt.cfg.vocab_size), jnp.int32)
            seen = counts > 0
        else:
            counts, seen = s.counts, s.seen
        logits = mask_logits(tgt.logits(h[:, 0]).astype(jnp.float32), st.grammar, s)
        tok = sample(logits, st, counts, seen, keys, sampled)
        cache = dataclasses.replace(cache, lengths=cache.lengths + active)
        hist = s.hist.at[:, 1].add(active.astype(jnp.int32))
        s = dataclasses.replace(s, cache=cache, verify_ct=s.verify_ct + active, hist=hist)
        s = emit(s, tok[:, None], jnp.ones((b,), jnp.int32), max_new_tokens, stop_ids, logits[:, None], st)
        s = dataclasses.replace(s, last=jnp.where(active, tok, s.last))
        toks = toks.at[:, i].set(tok)
        f = prop.features(h, cap)
        if f is not None:
            feats = feats.at[:, i].set(f[:, 0].astype(feats.dtype))
        return i + 1, s, toks, feats

    f = prop.features(*_feature_shapes(tgt, prop, b))
    toks = jnp.zeros((b, steps), jnp.int32)
    feats = jnp.zeros((b, steps, 1 if f is None else f.shape[-1]), tgt.dtype)
    ct0 = state.verify_ct
    carry = (jnp.int32(0), state, toks, feats)
    if early_exit:
        _, state, toks, feats = jax.lax.while_loop(lambda c: (c[0] < steps) & ~jnp.all(c[1].done), step, carry)
    else:
        _, state, toks, feats = jax.lax.fori_loop(0, steps, lambda _, c: step(c), carry)
    n = state.verify_ct - ct0  # steps each slot took part in
    if prop.root_in_region:  # block = [x_L, emitted...]
        block, n_block, bfeats = jnp.concatenate([first_last[:, None], toks], 1), n + 1, None
    else:  # block = emitted tokens with the target features of the tokens fed to produce them
        block, n_block, bfeats = toks, jnp.maximum(n, 1), (feats if prop.uses_hidden else None)
    dstate = prop.extend(dparams, tgt, state.draft, block, bfeats, n_block, n > 0)
    return dataclasses.replace(state, draft=dstate)


def _feature_shapes(tgt, prop: Proposer, b: int):
    """Placeholder (h [B, 1, H], captured [L, B, 1, H]) to read the draft feature width from."""
    hdim = tgt.cfg.hidden_size
    h = jnp.zeros((b, 1, hdim), tgt.dtype)
    cap = jnp.zeros((len(prop.capture_layers), b, 1, hdim), h.dtype) if prop.capture_layers else None
    return h, cap


def run_block(
    models: Models,
    spec: SpecConfig | None,
    state: SpecState,
    st: SamplingTensors,
    max_new_tokens,
    stop_ids,
    rounds: int,
    sampled: bool | str = True,
) -> SpecState:
    """Rounds of the tree shape `spec` in a while_loop: at most `rounds` of them (0: until every
    slot is done), stopping early once every slot is done. spec None: `rounds` plain decoding
    steps with the draft kept up to date (speculation off, for adaptive speculation)."""
    tgt, prop, dparams, backend = models.target(), models.draft, models.dparams, models.backend
    if spec is None:
        return plain_steps(tgt, prop, dparams, state, st, max_new_tokens, stop_ids, rounds, backend, sampled)
    consts = round_constants(tgt, prop, dparams, spec, st, sampled)
    _, state = jax.lax.while_loop(
        lambda c: ((c[0] < rounds) | (rounds == 0)) & ~jnp.all(c[1].done),
        lambda c: (
            c[0] + 1,
            spec_round(tgt, prop, dparams, spec, c[1], st, max_new_tokens, stop_ids, consts, backend, sampled=sampled),
        ),
        (jnp.int32(0), state),
    )
    return state


spec_block = jax.jit(run_block, static_argnames=("spec", "rounds", "sampled"), donate_argnames=("state",))


@functools.partial(
    jax.jit, static_argnames=("spec", "buf", "sampled", "top_logprobs"), donate_argnames=("cache", "dcache")
)
def spec_run(
    models: Models,
    spec: SpecConfig,
    cache: KVCache,
    dcache: KVCache,
    last_h,
    last_feat,
    st: SamplingTensors,
    max_new_tokens,
    stop_ids,
    buf: int,
    sampled: bool | str = True,
    top_logprobs: int | None = None,
) -> SpecState:
    """`spec_start`, then `spec_block`'s rounds until every slot is done, as one program: one
    dispatch per batch, and the state never crosses a program boundary (arguments as
    `spec_start`'s)."""
    state = start_state(
        models, spec, cache, dcache, last_h, last_feat, st, max_new_tokens, stop_ids, buf, sampled, top_logprobs
    )
    return run_block(models, spec, state, st, max_new_tokens, stop_ids, 0, sampled)

"""The server's device side: a fixed set of request slots that requests join and leave between
compiled dispatches (continuous batching). The host side (queue, streaming, HTTP) is in server/.

    batch = SlotBatch.create(...)                         # B slots, each with a context of S columns
    batch = admit_chunk(..., batch, rows, tokens, ...)    # prefill new requests into free slots
    batch, first = admit_finish(..., batch, rows, ...)    # their first token + per-slot parameters
    batch, outs = dispatch(..., batch, kill, k=..., n_act=..., span=...)   # k rounds for slots [0, n_act)
    batch = copy_prefix(batch, src, dst, length)  # prefix caching: a slot's KV columns into another

Shapes are static per program: `n` (admitted requests, bucketed), the prefill chunk, `n_act`
(a power of two covering the highest busy slot; the host fills low slots first) and `span`
(attention reads KV columns [0, span), bucketed above every busy slot's length). Everything else
(lengths, which slots are busy or killed) is data. Per-slot arrays are gathered / scattered with
`take_rows` / `put_rows`; KV caches are written in place through slot views (cache.py).

`prop is None` is plain decoding (the state is a DecodeState); otherwise a SpecState whose
`plain` slots decode without speculation inside the round (spec_round(plain=...)), and a dispatch
with `spec=None` runs plain steps for every slot, keeping the drafts up to date (speculation off,
chosen by adaptive speculation).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec import compile_target
from jaxspec.cache import KVCache
from jaxspec.decode import LENGTH, RUNNING, STOPPED, DecodeState, decode_step, target_prefill
from jaxspec.grammar import Emitted, mask_logits, sync
from jaxspec.logprobs import TokenLogprobs, compute
from jaxspec.sampling import SamplingTensors, sample
from jaxspec.sharding import put
from jaxspec.speculative.loop import SpecState, plain_steps, prefill_step, round_constants, spec_round
from jaxspec.speculative.proposers.base import DraftState
from jaxspec.speculative.proposers.suffix import SuffixCache
from jaxspec.weights import Models


def _is_cache(x) -> bool:
    return isinstance(x, KVCache)


def take_rows(tree, rows, span=None, prefix: int | None = None):
    """The slots `rows` [n] of a per-slot pytree: arrays -> x[rows], KV caches -> slot views.
    prefix=n promises rows == arange(n): arrays are sliced, caches read by slicing."""
    if prefix is not None:
        return jax.tree_util.tree_map(
            lambda x: x.view(rows, span, prefix=True) if _is_cache(x) else x[:prefix], tree, is_leaf=_is_cache
        )
    return jax.tree_util.tree_map(lambda x: x.view(rows, span) if _is_cache(x) else x[rows], tree, is_leaf=_is_cache)


def put_rows(tree, rows, sub):
    """Writes `sub` (from take_rows) back into the slots `rows` of `tree`."""
    return jax.tree_util.tree_map(
        lambda x, y: x.unview(y) if _is_cache(x) else x.at[rows].set(y), tree, sub, is_leaf=_is_cache
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotBatch:
    core: DecodeState | SpecState  # its `out` is the window [B, W] of the latest dispatch
    st: SamplingTensors  # [B] per-slot sampling parameters
    max_new: jax.Array  # [B] int32
    stop_ids: jax.Array  # [B, K] int32, -1 padded
    plain: jax.Array  # [B] bool: decode this slot without speculation
    last_h: jax.Array  # [B, H] prefill carry: target hidden of the last prompt token
    last_feat: jax.Array  # [B, F] prefill carry: the draft's feature of it ([B, 1] when unused)

    @classmethod
    def create(
        cls,
        cfg,
        prop,
        slots: int,
        max_len: int,
        window: int,
        num_stop: int,
        dtype,
        depth: int = 0,  # the speculative tree's depth bound (SpecConfig.depth)
        kv_sharding=None,
        top_logprobs: int | None = None,
        grammar: bool = False,
    ) -> SlotBatch:
        """Empty slots. max_len: KV columns per slot (context + the round's scratch region);
        window: tokens one dispatch can emit per slot; num_stop: stop-token columns;
        kv_sharding: where the target's KV buffers live (jaxspec/sharding.py); top_logprobs: None,
        or every emitted token's logprob is computed, with this many top alternatives; grammar:
        the slots carry grammar handles (st.grammar) for constrained requests (jaxspec/grammar.py)."""
        b, v = slots, cfg.vocab_size
        cache = KVCache.create(cfg, b, max_len, dtype, kv_sharding)
        zi = lambda *s: jnp.zeros(s, jnp.int32)
        common: dict[str, Any] = dict(
            out=zi(b, window),
            num_out=zi(b),
            done=jnp.ones((b,), bool),
            finish=zi(b),
            last=zi(b),
            cache=cache,
            base=zi(b),
            lps=None if top_logprobs is None else TokenLogprobs.zeros((b, window), top_logprobs),
        )
        core: DecodeState | SpecState
        if prop is None:
            core = DecodeState(counts=zi(b, v), seen=jnp.zeros((b, v), bool), **common)
            feat = 1
        else:
            draft = DraftState(
                prop.make_cache(b, max_len, dtype),
                jnp.zeros((b, prop.draft_vocab), jnp.float32),
                jnp.zeros((b, prop.cfg.hidden_size if prop.uses_hidden else 1), dtype),
            )
            core = SpecState(
                draft=draft,
                verify_ct=zi(b),
                hist=zi(b, depth + 2),
                counts=zi(b, v),
                seen=jnp.zeros((b, v), bool),
                **common,
            )
            feat = (3 if prop.capture_layers else 1) * cfg.hidden_size if prop.uses_hidden else 1
        st = SamplingTensors.build_default(b, grammar)
        return cls(
            core,
            st,
            zi(b),
            jnp.full((b, num_stop), -1, jnp.int32),
            jnp.zeros((b,), bool),
            jnp.zeros((b, cfg.hidden_size), dtype),
            jnp.zeros((b, feat), dtype),
        ).placed(put)

    def placed(self, put) -> SlotBatch:
        """Tensor parallel (the target's cache has a sharding): this batch with the target's KV buffers
        at that sharding and every other array replicated, by put(tree, sharding): jax.device_put at creation,
        jax.lax.with_sharding_constraint at the end of each program, so that every dispatch sees the
        same input shardings (the partitioner would otherwise leave e.g. counts split on the vocab,
        and the next call would recompile)."""
        c = self.core.cache
        if c.sharding is None:
            return self
        rep = NamedSharding(c.sharding.mesh, P())
        rest = put(dataclasses.replace(self, core=dataclasses.replace(self.core, cache=None)), rep)  # type: ignore[arg-type]
        cache = dataclasses.replace(c, k=put(c.k, c.sharding), v=put(c.v, c.sharding), lengths=put(c.lengths, rep))
        return dataclasses.replace(rest, core=dataclasses.replace(rest.core, cache=cache))


COPY_BLOCK = 64  # columns copy_prefix moves per loop iteration


@functools.partial(jax.jit, donate_argnames=("batch",))
def copy_prefix(batch: SlotBatch, src, dst, length) -> SlotBatch:
    """Copies columns [0, length) of slot `src` into slot `dst` (scalars int32) in every per-column
    array of the target's and the draft's caches (KV buffers [B, S, Hkv, D], NGRAM's token history
    [B, S]), and sets dst's cache lengths to `length` (the columns reused): until its prefill
    starts, dispatches that stop dst (it is not decoding) write only past them. Every other
    per-slot field is left to the prefill that follows. Prefix caching: a new request reuses the
    KV of a prompt prefix computed in another slot. The copy runs COPY_BLOCK columns at a time for
    as many blocks as `length` needs (a loop of data-dependent length: one program for every
    length, and columns past the prefix are neither read nor written, so on a CPU their pages
    stay unallocated)."""
    core = batch.core
    cols = core.cache.max_len
    blocks = (length + COPY_BLOCK - 1) // COPY_BLOCK

    def copy(x):
        if x.ndim < 2 or x.shape[1] != cols:
            return x
        size = (1, COPY_BLOCK) + x.shape[2:]

        def block(i, x):
            col = jnp.minimum(i * COPY_BLOCK, cols - COPY_BLOCK)
            tail = (0,) * (x.ndim - 2)
            part = jax.lax.dynamic_slice(x, (src, col) + tail, size)
            return jax.lax.dynamic_update_slice(x, part, (dst, col) + tail)

        return jax.lax.fori_loop(0, blocks, block, x)

    def fix(c):  # a cache (KVCache, NGRAM's history, both): its columns copied, dst's length set
        if isinstance(c, SuffixCache):
            return SuffixCache(fix(c.kv), fix(c.text))
        c = jax.tree_util.tree_map(copy, c)
        return dataclasses.replace(c, lengths=c.lengths.at[dst].set(length))

    core = dataclasses.replace(core, cache=fix(core.cache))
    if isinstance(core, SpecState):
        core = dataclasses.replace(core, draft=dataclasses.replace(core.draft, cache=fix(core.draft.cache)))
    return dataclasses.replace(batch, core=core).placed(jax.lax.with_sharding_constraint)


@functools.partial(jax.jit, static_argnames=("span",), donate_argnames=("batch",))
def admit_chunk(models: Models, batch: SlotBatch, rows, tokens, dtokens, start, prompt_lens, span: int):
    """Prefills one chunk of n new requests into the slots `rows` [n].

    tokens: [n, C] prompt tokens at positions [start, start + C); dtokens: the draft's tokens for the
    same entries (prompt shifted by prop.shift; unused when prop is None); prompt_lens: [n]."""
    tgt, prop, dparams, backend = models.target(), models.prop, models.dparams, models.backend
    core = batch.core
    cache = core.cache.view(rows, span)
    last_h, last_feat = batch.last_h[rows], batch.last_feat[rows]
    if prop is None:
        h, _, cache, keep = target_prefill(tgt, cache, tokens, start, prompt_lens, backend=backend)
        last_h = keep(h, last_h)
    else:
        assert isinstance(core, SpecState)
        dcache = take_rows(core.draft.cache, rows, span)
        cache, dcache, last_h, last_feat = prefill_step(
            tgt, prop, dparams, cache, dcache, tokens, dtokens, start, prompt_lens, last_h, last_feat, backend
        )
        core = dataclasses.replace(
            core, draft=dataclasses.replace(core.draft, cache=put_rows(core.draft.cache, rows, dcache))
        )
    core = dataclasses.replace(core, cache=core.cache.unview(cache))
    batch = dataclasses.replace(
        batch, core=core, last_h=batch.last_h.at[rows].set(last_h), last_feat=batch.last_feat.at[rows].set(last_feat)
    )
    return batch.placed(jax.lax.with_sharding_constraint)


@functools.partial(jax.jit, static_argnames=("span",), donate_argnames=("batch",))
def admit_finish(
    models: Models, batch: SlotBatch, rows, st: SamplingTensors, max_new, stop_ids, plain, seen, span: int
):
    """After the last prefill chunk: samples each new request's first token, starts its draft, and
    sets its slot's parameters. st: [n]; max_new: [n] (>= 1); stop_ids: [n, K]; plain: [n] bool;
    seen: [n, V] bool prompt tokens. Returns (batch, (first tokens [n], their TokenLogprobs [n, 1]
    or None when the batch records no logprobs))."""
    tgt, prop, dparams = models.target(), models.prop, models.dparams
    n = rows.shape[0]
    counts = jnp.zeros(seen.shape, jnp.int32)
    keys = jax.vmap(jax.random.fold_in)(st.keys, jnp.zeros((n,), jnp.int32))
    logits = tgt.logits(batch.last_h[rows]).astype(jnp.float32)
    logits = mask_logits(logits, st.grammar, Emitted.none(n))
    first = sample(logits, st, counts, seen, keys)
    # constrained requests: their matchers consume the first token before any dispatch runs
    synced = sync(st.grammar, Emitted(first[:, None], jnp.ones((n,), jnp.int32), None, jnp.zeros((n,), bool)))
    core = batch.core
    first_lps = None if core.lps is None else compute(logits[:, None], first[:, None], st.temperature, core.lps.k)
    is_stop = jnp.any(first[:, None] == stop_ids, -1)
    done = is_stop | (max_new <= 1)
    one = jax.nn.one_hot(first, seen.shape[1], dtype=jnp.int32)
    fields = dict(
        num_out=jnp.ones((n,), jnp.int32),
        base=jnp.ones((n,), jnp.int32),
        done=done,
        finish=jnp.where(is_stop, STOPPED, jnp.where(done, LENGTH, RUNNING)).astype(jnp.int32),
        last=first,
        counts=one,
        seen=seen | (one > 0),
    )
    put = lambda name, x: getattr(core, name).at[rows].set(x)
    if prop is not None:
        assert isinstance(core, SpecState)
        d = take_rows(core.draft, rows, span)
        feats = batch.last_feat[rows][:, None] if prop.uses_hidden else None
        d = prop.extend(dparams, tgt, d, first[:, None], feats, jnp.ones((n,), jnp.int32), jnp.ones((n,), bool))
        core = dataclasses.replace(core, draft=put_rows(core.draft, rows, d))
        fields.update(verify_ct=jnp.zeros((n,), jnp.int32), hist=jnp.zeros((n,) + core.hist.shape[1:], jnp.int32))
    core = dataclasses.replace(core, **{k: put(k, v) for k, v in fields.items()})
    batch = dataclasses.replace(
        batch,
        core=core,
        st=put_rows(batch.st, rows, st),
        max_new=batch.max_new.at[rows].set(max_new),
        stop_ids=batch.stop_ids.at[rows].set(stop_ids),
        plain=batch.plain.at[rows].set(plain),
    )
    return batch.placed(jax.lax.with_sharding_constraint), (first, first_lps, synced)


@functools.partial(
    jax.jit,
    static_argnames=("spec", "k", "n_act", "span", "sampled", "logprobs", "grammar"),
    donate_argnames=("batch",),
)
def dispatch(
    models: Models,
    spec,
    batch: SlotBatch,
    kill,
    k: int,
    n_act: int,
    span: int,
    sampled: bool = True,
    logprobs: bool = False,
    grammar: bool = False,
):
    """k rounds (plain: decode steps) for slots [0, n_act). With a proposer and spec None: W
    plain steps instead (W = the window, the tokens k rounds can emit), then one draft extension.
    On a GPU the k rounds always run (a
    loop of known trip count: no predicate goes back to the host between rounds, so the whole
    dispatch can stay one CUDA graph; finished slots are padding); on a CPU the loop stops early
    once every slot is done, which saves the rounds' compute. sampled (static): some slot has
    temperature > 0 (False: a greedy-only program, without the sampler). logprobs (static): compute
    every emitted token's logprob and top alternatives into the window's `lps` (False: they are left
    stale; a top-k over the vocabulary per token is a visible share of a CPU round). grammar
    (static): some slot is constrained (jaxspec/grammar.py): tokens are masked by each slot's
    matcher, which consumes the dispatch's tokens before it returns (False: no mask, no callback).

    kill: [B] bool, slots to stop first (cancelled requests). Returns (batch, outs) with outs =
    (window tokens [n_act, W], new-token counts [n_act], done [n_act], finish [n_act],
    verify_ct [n_act], hist [n_act, D + 2], window logprobs TokenLogprobs [n_act, W] or None[,
    grammar: output tokens each matcher has consumed [n_act]); plain mode reports
    verify_ct = num_out and no hist."""
    tgt, prop, dparams, backend = models.target(), models.prop, models.dparams, models.backend
    rows = jnp.arange(n_act)
    sub = take_rows(batch, rows, span, prefix=n_act)
    st = sub.st if grammar else dataclasses.replace(sub.st, grammar=None)
    core = sub.core
    core = dataclasses.replace(core, done=core.done | kill[:n_act], out=jnp.zeros_like(core.out), base=core.num_out)
    lps = core.lps
    if not logprobs:
        core = dataclasses.replace(core, lps=None)
    cpu = compile_target.platform() == "cpu"
    trips = k
    if prop is None:
        step = lambda s: decode_step(tgt, s, st, sub.max_new, sub.stop_ids, backend, sampled)
    elif spec is None:  # one call: W steps and the draft's catch-up
        w, trips = core.out.shape[1], 1
        step = lambda s: plain_steps(tgt, prop, dparams, s, st, sub.max_new, sub.stop_ids, w, backend, sampled, cpu)
    else:
        consts = round_constants(tgt, prop, dparams, spec, st, sampled)
        step = lambda s: spec_round(
            tgt,
            prop,
            dparams,
            spec,
            s,
            st,
            sub.max_new,
            sub.stop_ids,
            consts,
            backend,
            plain=sub.plain,
            sampled=sampled,
        )
    if trips == 1:
        core = step(core)
    elif cpu:
        _, core = jax.lax.while_loop(
            lambda c: (c[0] < trips) & ~jnp.all(c[1].done), lambda c: (c[0] + 1, step(c[1])), (jnp.int32(0), core)
        )
    else:
        core = jax.lax.fori_loop(0, trips, lambda _, c: step(c), core)
    if not logprobs:
        core = dataclasses.replace(core, lps=lps)
    batch = put_rows(batch, rows, dataclasses.replace(sub, core=core))
    if prop is None:
        extra = (core.num_out, jnp.zeros((n_act, 1), jnp.int32))
    else:
        extra = (core.verify_ct, core.hist)
    synced = () if not grammar else (sync(st.grammar, core),)
    return batch.placed(jax.lax.with_sharding_constraint), (
        core.out,
        core.num_out - core.base,
        core.done,
        core.finish,
        *extra,
        core.lps,
        *synced,
    )

"""Plain (non-speculative) decoding: chunked prefill, then one jitted `lax.while_loop`.

Compiled functions take the model as one `Models` argument (jaxspec/weights.py: the weights traced,
the module structure and attention backend static) and the KV cache, which is donated so XLA
updates it in place.

Finish codes per slot: RUNNING, STOPPED (a stop/EOS token, kept in the output), LENGTH.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.grammar import mask_logits
from jaxspec.logprobs import TokenLogprobs, compute
from jaxspec.sampling import SamplingTensors, sample
from jaxspec.weights import Models

RUNNING, STOPPED, LENGTH = 0, 1, 2


def pick_rows(x, idx):
    """x: [B, T, ...], idx: [B] -> x[b, idx[b]]: [B, ...]."""
    return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def target_prefill(model, cache: KVCache, tokens, start, prompt_lens, capture_layers=(), backend="xla"):
    """The target's forward over one prefill chunk (tokens [B, C] at positions start + t).

    Returns (h [B, C, H], captured, cache with lengths = min(prompt_lens, start + C), keep) where
    keep(x [B, C, ...], prev [B, ...]) replaces prev by each slot's last-prompt-token row of x when
    that token falls in this chunk."""
    b, c = tokens.shape
    cache = dataclasses.replace(cache, lengths=jnp.full((b,), start, jnp.int32))
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    h, cache, cap = model(tokens, positions, cache, capture_layers=capture_layers, backend=backend)
    cache = dataclasses.replace(cache, lengths=jnp.minimum(prompt_lens, start + c))
    idx = prompt_lens - 1 - start  # index of the last prompt token inside this chunk
    in_chunk = ((idx >= 0) & (idx < c))[:, None]
    cidx = jnp.clip(idx, 0, c - 1)

    def keep(x, prev):
        return jnp.where(in_chunk, pick_rows(x, cidx).astype(prev.dtype), prev)

    return h, cap, cache, keep


@functools.partial(jax.jit, donate_argnames=("cache",))
def prefill_chunk(models: Models, cache: KVCache, tokens, start, prompt_lens, last_h):
    """Runs one prefill chunk for all slots.

    tokens: [B, C] int32, the prompt tokens at positions [start, start + C) (padding past the end).
    start: scalar int32; prompt_lens: [B]; last_h: [B, H] hidden state of each slot's last prompt
    token so far (updated when it falls in this chunk). Returns (cache, last_h)."""
    h, _, cache, keep = target_prefill(models.target(), cache, tokens, start, prompt_lens, backend=models.backend)
    return cache, keep(h, last_h)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    out: jax.Array  # [B, M] int32 generated tokens
    num_out: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    finish: jax.Array  # [B] int32 finish code
    last: jax.Array  # [B] int32 last generated token (its KV is not written yet)
    counts: jax.Array  # [B, V] int32 output-token counts (frequency/presence penalties)
    seen: jax.Array  # [B, V] bool prompt + output tokens (repetition penalty)
    cache: KVCache
    base: jax.Array | None = None  # [B] server: `out` is a window holding tokens base .. num_out - 1
    lps: TokenLogprobs | None = None  # [B, M(, K)] logprobs of `out`'s tokens (when requested)


def init_state(
    cache: KVCache, prompt, prompt_lens, max_new_tokens, vocab: int, buf: int, top_logprobs: int | None = None
) -> DecodeState:
    b, p = prompt.shape
    rows = jnp.arange(b)[:, None]
    valid = jnp.arange(p)[None, :] < prompt_lens[:, None]
    seen = jnp.zeros((b, vocab), bool).at[rows, prompt].max(valid)
    return DecodeState(
        out=jnp.zeros((b, buf), jnp.int32),
        num_out=jnp.zeros((b,), jnp.int32),
        done=max_new_tokens <= 0,
        finish=jnp.where(max_new_tokens <= 0, LENGTH, RUNNING).astype(jnp.int32),
        last=jnp.zeros((b,), jnp.int32),
        counts=jnp.zeros((b, vocab), jnp.int32),
        seen=seen,
        cache=cache,
        lps=None if top_logprobs is None else TokenLogprobs.zeros((b, buf), top_logprobs),
    )


def record(state: DecodeState, logits, st: SamplingTensors, max_new_tokens, stop_ids, sampled=True) -> DecodeState:
    """Samples one token per active slot from logits [B, V] and updates outputs and finish flags.
    sampled (static): some slot has temperature > 0 (False: argmax only).

    stop_ids: [B, K] int32 (-1 padded) tokens that end a request (EOS unless ignore_eos, stop_token_ids)."""
    b = logits.shape[0]
    keys = jax.vmap(jax.random.fold_in)(st.keys, state.num_out)
    logits = mask_logits(logits, st.grammar, state)
    tok = sample(logits, st, state.counts, state.seen, keys, sampled)
    active = ~state.done
    rows = jnp.arange(b)
    col = state.num_out if state.base is None else state.num_out - state.base
    out = state.out.at[rows, col].set(jnp.where(active, tok, 0), mode="drop")
    counts = state.counts.at[rows, tok].add(active.astype(jnp.int32))
    seen = state.seen.at[rows, tok].max(active)
    num_out = state.num_out + active
    hit_stop = active & jnp.any(tok[:, None] == stop_ids, axis=-1)
    hit_len = active & ~hit_stop & (num_out >= max_new_tokens)
    finish = jnp.where(hit_stop, STOPPED, jnp.where(hit_len, LENGTH, state.finish))
    lps = state.lps
    if lps is not None:
        new = compute(logits[:, None], tok[:, None], st.temperature, lps.k)
        lps = lps.scatter(rows[:, None], jnp.where(active, col, out.shape[1])[:, None], new)
    return dataclasses.replace(
        state,
        lps=lps,
        out=out,
        num_out=num_out,
        done=state.done | hit_stop | hit_len,
        finish=finish,
        last=jnp.where(active, tok, state.last),
        counts=counts,
        seen=seen,
    )


def decode_step(model, state: DecodeState, st, max_new_tokens, stop_ids, backend="xla", sampled=True) -> DecodeState:
    """Feeds each slot's last token, writes its KV, samples the next token."""
    cache = state.cache
    h, cache, _ = model(state.last[:, None], cache.lengths[:, None], cache, backend=backend)
    cache = dataclasses.replace(cache, lengths=cache.lengths + (~state.done))
    logits = model.logits(h[:, 0])
    return record(dataclasses.replace(state, cache=cache), logits, st, max_new_tokens, stop_ids, sampled)


@functools.partial(jax.jit, static_argnames=("buf", "sampled", "top_logprobs"), donate_argnames=("cache",))
def decode(
    models: Models,
    cache: KVCache,
    last_h,
    prompt,
    prompt_lens,
    st: SamplingTensors,
    max_new_tokens,
    stop_ids,
    buf: int,
    sampled: bool | str = True,
    top_logprobs: int | None = None,
):
    """Samples the first token from the prefill's last hidden state, then decodes in a while_loop.

    cache: after prefill (lengths = prompt_lens); last_h: [B, H]; prompt: [B, P] int32;
    max_new_tokens: [B] int32 (<= buf); stop_ids: [B, K]; top_logprobs (static): None, or the
    number of top alternatives to record with each token's logprob. Returns (out [B, buf],
    num_out [B], finish [B], cache, lps: TokenLogprobs [B, buf] or None)."""
    model, backend = models.target(), models.backend
    state = init_state(cache, prompt, prompt_lens, max_new_tokens, model.cfg.vocab_size, buf, top_logprobs)
    state = record(state, model.logits(last_h), st, max_new_tokens, stop_ids, sampled)

    def cond(s):
        return ~jnp.all(s.done)

    def body(s):
        return decode_step(model, s, st, max_new_tokens, stop_ids, backend, sampled)

    state = jax.lax.while_loop(cond, body, state)
    return state.out, state.num_out, state.finish, state.cache, state.lps


@functools.partial(jax.jit, static_argnames=("k", "chunk"))
def prompt_logprobs(models: Models, tokens, temperature, k: int, chunk: int = 256) -> TokenLogprobs:
    """The target's log-probability of every prompt token given the tokens before it.

    tokens: [1, P] int32 (P a multiple of chunk; padding after the prompt is harmless, its rows are
    ignored by the caller); temperature: [1]. Returns TokenLogprobs [P] where entry i scores token i
    (entry 0, which no position predicts, is 0). The forward runs over a scratch cache of P columns
    (no request's KV is touched); logits are formed `chunk` positions at a time, so memory holds
    [chunk, V] of them, not [P, V]."""
    model = models.target()
    p = tokens.shape[1]
    cache = KVCache.create(model.cfg, 1, p, model.dtype)
    h, _, _, _ = target_prefill(model, cache, tokens, 0, jnp.full((1,), p, jnp.int32), backend=models.backend)
    nxt = jnp.concatenate([tokens[0, 1:], jnp.zeros((1,), tokens.dtype)])  # position i predicts token i + 1
    hs = h[0].reshape(p // chunk, chunk, -1)
    ts = nxt.reshape(p // chunk, chunk)

    def block(x):
        hb, tb = x
        return compute(model.logits(hb)[None], tb[None], temperature, k)

    out = jax.lax.map(block, (hs, ts))
    flat = jax.tree_util.tree_map(lambda a: a.reshape((p,) + a.shape[3:]), out)
    # shift right by one: entry i scores token i
    shift = lambda a: jnp.concatenate([jnp.zeros((1,) + a.shape[1:], a.dtype), a[:-1]], 0)
    return jax.tree_util.tree_map(shift, flat)

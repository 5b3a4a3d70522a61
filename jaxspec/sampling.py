"""Sampling: per-request parameters, their device form, penalties and the token sampler.

The same `sample` is used by plain decoding and by speculative verification, so both
see identical target distributions. All parameters are per-slot arrays: one compiled program
serves any mix of greedy and sampled requests.

Order (SGLang): penalties -> temperature -> top-k / top-p / min-p -> draw; temperature == 0 is greedy.
The filters are applied without sorting the vocabulary (one threshold found by bisection,
`kept_threshold`, 32 passes over the logits; programs for requests that filter nothing leave it
out, see `sampling_kind`) and the draw reads the vocabulary once (`draw`), so nothing in the
program waits on the host. A program that serves any mix (the server's) skips on CPU, by a
conditional, the work no row of the call needs (SKIP_UNUSED); on a GPU it stays straight-line.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, ClassVar

import jax
import jax.numpy as jnp
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from jaxspec import compile_target
from jaxspec.errors import JaxspecError
from jaxspec.speculative.short_axis import row_argmax, row_max_argmax, row_sum

GREEDY_EPS = 1e-6


INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 32  # per request
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64  # before the per-engine limit (the server keeps a few stop-id columns per slot)
MAX_GRAMMAR_CHARS = 100_000  # json_schema / regex / ebnf


# field types shared with the server's request schemas (server/protocol.py)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopStr = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
Stop = StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)] | None
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1, description="any 64-bit integer (signed or unsigned)")] | None
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX, description="-1 = off; otherwise >= 1")]


def _param(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class SamplingParams:
    """Per-request parameters, named as in SGLang's `sampling_params` dict.

    The annotations are the schema: `from_dict` / `validate` check types and ranges with pydantic,
    and the server publishes the same schema in /openapi.json. Ranges are SGLang's and OpenAI's."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    max_new_tokens: Count = _param(128, "most tokens to generate")
    temperature: Annotated[float, Field(allow_inf_nan=False, ge=0)] = _param(1.0, "0 = greedy")
    top_p: Annotated[float, Field(allow_inf_nan=False, gt=0, le=1)] = _param(
        1.0, "nucleus sampling: smallest set of tokens whose probability reaches this"
    )
    top_k: TopK = _param(-1, "sample among the k most likely tokens (-1 = all)")
    min_p: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1)] = _param(
        0.0, "drop tokens less likely than this times the most likely one"
    )
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False, ge=-2, le=2)] = _param(
        0.0, "subtracted from a token's logit once per earlier occurrence in the output"
    )
    presence_penalty: Annotated[float, Field(allow_inf_nan=False, ge=-2, le=2)] = _param(
        0.0, "subtracted from the logit of every token already in the output"
    )
    repetition_penalty: Annotated[float, Field(allow_inf_nan=False, gt=0, le=2)] = _param(
        1.0, "divides positive (multiplies negative) logits of tokens seen in prompt or output"
    )
    stop: Stop = _param(None, "stop string (repeatable); not part of the output")
    stop_token_ids: StopTokenIds = _param(None, "token ids that end generation (besides EOS)")
    ignore_eos: bool = _param(False, "keep generating past EOS")
    seed: Seed = _param(None, "per-request sampling seed (default: drawn from --random-seed)")
    skip_special_tokens: bool = _param(True, "leave special tokens out of the text")
    json_schema: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | dict[str, Any] | None = _param(
        None, "constrain the output to JSON that fits this JSON Schema (a JSON string or a dict)"
    )
    regex: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = _param(
        None, "constrain the output to text that fully matches this regular expression"
    )
    ebnf: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = _param(
        None, "constrain the output to this grammar (GBNF, as llama.cpp writes it, or Lark)"
    )

    ALIASES: ClassVar[dict[str, str]] = {"sampling_seed": "seed", "max_tokens": "max_new_tokens"}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        if isinstance(d, SamplingParams):
            d.validate()
            return d
        if d is not None and not isinstance(d, dict):
            raise JaxspecError(f"sampling parameters must be a dict, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for given, v in (d or {}).items():
            k = cls.ALIASES.get(given, given)
            if v is not None:
                if k in spelled:  # an alias and its field (max_tokens and max_new_tokens): which one is meant?
                    raise JaxspecError(
                        f"invalid sampling parameter: {spelled[k]} and {given} are the same parameter; pass one"
                    )
                spelled[k] = given
            if k == "n":
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    raise JaxspecError(f"invalid sampling parameter: n must be a positive integer, got {v!r}")
                if v not in (None, 1):
                    raise JaxspecError("n > 1 is handled by Engine.generate and the server, not by SamplingParams")
                continue
            if k not in fields:
                raise JaxspecError(f"unknown sampling parameter {k!r}; known: {', '.join(sorted(fields))}")
            if v is not None:
                kw[k] = v
        return _checked(kw)

    def validate(self) -> None:
        """Raises JaxspecError naming the first bad field (types, ranges)."""
        _checked({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def split_n(d: Any) -> tuple[Any, int]:
    """(sampling_params without `n`, n): how many samples to draw per prompt (SGLang's `n`)."""
    if not isinstance(d, dict) or "n" not in d:
        return d, 1
    n = d["n"]
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise JaxspecError(f"invalid sampling parameter: n must be a positive integer, got {n!r}")
    return {k: v for k, v in d.items() if k != "n"}, n


def nth_sample(p: SamplingParams, j: int) -> SamplingParams:
    """The parameters of sample j of n: a seeded request's samples get seeds seed, seed + 1, ...
    (wrapping within the 64-bit range), so each is reproducible and they differ; unseeded ones
    draw their own seeds."""
    if j == 0 or p.seed is None:
        return p
    seed = p.seed + j
    if seed > 2**64 - 1:
        seed -= 2**64 + 2**63  # wraps to the bottom of the accepted range
    return dataclasses.replace(p, seed=seed)


@functools.cache
def sampling_params_schema() -> TypeAdapter:
    """The pydantic validator (and JSON schema) of SamplingParams."""
    return TypeAdapter(SamplingParams)


def _checked(kw: dict) -> SamplingParams:
    try:
        p = sampling_params_schema().validate_python(kw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        raise JaxspecError(f"invalid sampling parameter: {loc}: {err['msg']} (got {got})") from None
    if p.top_k == 0:
        raise JaxspecError("invalid sampling parameter: top_k must be -1 (off) or >= 1, got 0")
    return p


TEMPERATURE_ONLY = "temperature"  # `sampled` value: rows draw, but none filters (top-k/top-p/min-p off)


def any_sampled(params) -> bool:
    """Whether some of these SamplingParams draw (temperature > 0): the `sampled` static argument
    of the decoding programs, which leave the sampler out when it is False."""
    return any(p.temperature > GREEDY_EPS for p in params)


def sampling_kind(params) -> bool | str:
    """The most specific `sampled` static argument that serves these SamplingParams: False (all
    greedy: no sampler), TEMPERATURE_ONLY (some draw, none filters: the sampler without the
    threshold search, which is 32 passes over the vocabulary) or True (any mix)."""
    drawing = [p for p in params if p.temperature > GREEDY_EPS]
    if not drawing:
        return False
    unfiltered = all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in drawing)
    return TEMPERATURE_ONLY if unfiltered else True


def seed_bits(seed: int) -> int:
    """A 64-bit seed (signed or unsigned) folded to the 32 bits a PRNG key is made from; seeds in
    [0, 2^32) map to themselves, so small seeds give the same streams as before folding."""
    s = int(seed) % 2**64
    return (s ^ (s >> 32)) & 0xFFFFFFFF


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    """Device form of a batch of SamplingParams; every field is [B]."""

    temperature: jax.Array
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    keys: jax.Array  # typed PRNG keys [B]
    # int32 [B] grammar handles (jaxspec/grammar.py; -1 = unconstrained), or None: no row is
    # constrained and the programs hold no grammar masks at all
    grammar: jax.Array | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], grammar: list[int] | None = None) -> SamplingTensors:
        f32 = lambda name: jnp.asarray([getattr(p, name) for p in params], jnp.float32)
        return cls(
            temperature=f32("temperature"),
            top_k=jnp.asarray([max(p.top_k, 0) for p in params], jnp.int32),
            top_p=f32("top_p"),
            min_p=f32("min_p"),
            repetition_penalty=f32("repetition_penalty"),
            frequency_penalty=f32("frequency_penalty"),
            presence_penalty=f32("presence_penalty"),
            keys=jax.vmap(jax.random.key)(jnp.asarray([seed_bits(s) for s in seeds], jnp.uint32)),
            grammar=None if grammar is None else jnp.asarray(grammar, jnp.int32),
        )

    @classmethod
    def build_default(cls, batch: int, grammar: bool = False) -> SamplingTensors:
        """Greedy placeholders for `batch` empty slots (grammar: with unconstrained handles)."""
        return cls.build([SamplingParams(temperature=0.0)] * batch, [0] * batch, [-1] * batch if grammar else None)


def apply_penalties(logits, st: SamplingTensors, counts, seen):
    """logits [B, V] f32; counts [B, V] int32 (output tokens); seen [B, V] bool (prompt + output)."""
    rp = st.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - st.frequency_penalty[:, None] * counts
    return logits - st.presence_penalty[:, None] * (counts > 0)


BISECT_STEPS = 32  # halvings of the int32 key range: the threshold is exact
# From this many rows, where the sampler skips unused work (XLA:CPU, see SKIP_UNUSED), the halvings
# run as a loop of four per iteration: as fast as straight-line code there, and an eighth of its
# size in every compiled program that samples (a program's memory grows with its instructions;
# benchmarks/RESULTS.md). One row stays unrolled (the loop cost it 0.3 ms a draw), and so do GPU
# programs, whose loops a CUDA graph may not hold.
BISECT_LOOP_ROWS = 2
# Whether the sampler skips, by a conditional, the work no row of the call needs (the threshold
# search when no drawing row filters, the draw when no row draws): None = on CPU only. XLA:CPU
# runs a conditional as a branch on the host thread, so a greedy call served by a sampling program
# costs what the greedy program does. XLA:GPU copies a conditional's predicate to the host, which
# a CUDA graph cannot hold, so there the programs stay straight-line and compute both.
SKIP_UNUSED: bool | None = None


def skips_unused() -> bool:
    """SKIP_UNUSED as it applies to programs traced now (the default backend's)."""
    return compile_target.platform() == "cpu" if SKIP_UNUSED is None else SKIP_UNUSED


def draws(st: SamplingTensors):
    """[B] bool: the rows that draw (temperature > 0); the others take the argmax."""
    return st.temperature > GREEDY_EPS


def filters(st: SamplingTensors):
    """[B] bool: the rows that draw from a filtered distribution (top-k, top-p or min-p set)."""
    return draws(st) & ((st.top_k > 0) | (st.top_p < 1.0) | (st.min_p > 0.0))


DRAW_BLOCK = 256  # the draw sums the vocabulary in blocks of this many entries


def order_keys(z):
    """float32 [...] -> int32 [...] in the same order (a total order on non-NaN floats), so a
    threshold on values can be searched by halving an integer range."""
    i = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.int32)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


def kept_threshold(z, st: SamplingTensors):
    """The filter as one threshold: z [R, V] temperature-scaled logits -> int32 key t [R] such that
    the kept tokens are exactly those with order_keys(z) >= t. No sort.

    SGLang's filters on the full-vocabulary probabilities p = softmax(z), each keeping the most
    likely tokens, so the kept set is {z >= t} with t the largest of the three cut-offs:
      top-k   keep z_i if fewer than k tokens have a larger z
      top-p   keep z_i if the tokens with a larger z hold at most top_p of the mass
      min-p   keep z_i if p_i >= min_p * max(p)
    Tokens of equal z are kept or dropped together (a sort would cut between them by index).
    t is the smallest key x for which no filter still cuts, i.e. none of
    count(z > x) >= k, mass(z > x) > top_p, x < key(max z + log min_p) holds; all three are
    monotone in x, so BISECT_STEPS halvings of the int32 range find it exactly, each one a pass
    over [R, V]."""
    r, v = z.shape
    keys = order_keys(z)
    zmax = jnp.max(z, axis=-1)
    p = jnp.exp(z - zmax[:, None])
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    k = jnp.where(st.top_k > 0, st.top_k, v + 1)
    t_min = order_keys(zmax + jnp.log(st.min_p))  # -inf for min_p = 0

    def cuts(x):  # [R] -> [R] bool: some filter drops tokens with key <= x
        above = keys > x[:, None]
        count = jnp.sum(above, axis=-1)
        mass = jnp.sum(jnp.where(above, p, 0.0), axis=-1)
        # top_p = 1 keeps everything: a float32 mass that rounds above 1 must not cut the tail
        return (count >= k) | ((mass > st.top_p) & (st.top_p < 1.0)) | (x < t_min)

    def halve(_, bounds):
        lo, hi = bounds
        gap = jax.lax.bitcast_convert_type(hi - lo, jnp.uint32)  # hi - lo wraps in int32; as uint32 it is exact
        mid = lo + (gap >> 1).astype(jnp.int32)
        c = cuts(mid)
        return jnp.where(c, mid, lo), jnp.where(c, hi, mid)

    bounds = (
        jnp.full((r,), jnp.iinfo(jnp.int32).min, jnp.int32),  # lo: below every float's key
        order_keys(zmax),  # hi: nothing cuts at the maximum
    )
    if skips_unused() and r >= BISECT_LOOP_ROWS:
        return jax.lax.fori_loop(0, BISECT_STEPS, halve, bounds, unroll=4)[1]
    for i in range(BISECT_STEPS):  # unrolled: straight-line code, no loop for XLA to run
        bounds = halve(i, bounds)
    return bounds[1]


def kept_weights(logits, st: SamplingTensors, filtered: bool = True, logits_max=None):
    """logits [R, V] -> unnormalised probabilities [R, V] of the filtered distribution `sample`
    draws from (temperature, top-k, top-p, min-p; zero outside the kept set). The most likely
    token is always kept, with weight 1. filtered (static) False: no row filters, so the
    threshold search is left out (every token is kept, as the search would find). logits_max
    [R]: the logits' largest, where the caller has it (a reduction over the vocabulary saved;
    dividing by the temperature keeps the order, so it gives z's largest exactly)."""
    t = jnp.maximum(st.temperature, GREEDY_EPS)[:, None]
    z = logits.astype(jnp.float32) / t
    if logits_max is None:
        zmax = jnp.max(z, axis=-1, keepdims=True)
    else:
        zmax = logits_max.astype(jnp.float32)[:, None] / t
    if not filtered:
        return jnp.exp(z - zmax)
    if skips_unused():  # keep-all threshold (below every key) when no row filters
        keep_all = lambda: jnp.full(z.shape[:1], jnp.iinfo(jnp.int32).min, jnp.int32)
        t = jax.lax.cond(jnp.any(filters(st)), lambda: kept_threshold(z, st), keep_all)
    else:
        t = kept_threshold(z, st)
    return jnp.where(order_keys(z) >= t[:, None], jnp.exp(z - zmax), 0.0)


def target_probs(logits, st: SamplingTensors, filtered: bool = True, logits_max=None):
    """The distribution `sample` draws from, as probabilities over the vocabulary [R, V]."""
    w = kept_weights(logits, st, filtered, logits_max)
    return w / row_sum(w, keepdims=True)


def draw(w, u):
    """Inverse-CDF draw: w [R, V] >= 0 (some entry > 0 per row), u [R] uniform in [0, 1) ->
    index [R] int32 with probability w / sum(w). Two levels (block sums, then one block), so the
    vocabulary is read once and only DRAW_BLOCK entries are scanned; one random number per row."""
    r, v = w.shape
    blk = min(DRAW_BLOCK, v)
    wb = jnp.pad(w, ((0, 0), (0, -v % blk))).reshape(r, -1, blk)
    bsum = jnp.sum(wb, axis=-1)  # [R, nb]
    cb = jnp.cumsum(bsum, axis=-1)
    target = u * cb[:, -1]
    nb = bsum.shape[1]
    # the first block whose running sum passes the target (rounding past the end: the last non-empty block)
    last_b = jnp.max(jnp.where(bsum > 0, jnp.arange(nb), 0), axis=-1)
    bi = jnp.minimum(jnp.sum(cb <= target[:, None], axis=-1), last_b)
    inner = jnp.take_along_axis(wb, bi[:, None, None], axis=1)[:, 0]  # [R, blk]
    before = jnp.take_along_axis(cb - bsum, bi[:, None], axis=1)[:, 0]
    rest = jnp.maximum(target - before, 0.0)
    last_i = jnp.max(jnp.where(inner > 0, jnp.arange(blk), 0), axis=-1)
    ii = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= rest[:, None], axis=-1), last_i)
    return (bi * blk + ii).astype(jnp.int32)


FALLBACK_SHIFT = 1000.0  # draw_keyed's fallback scores lie this far below every real one


def draw_keyed(w, keys, fallback=None):
    """w [R, V] >= 0, keys: typed PRNG keys [R] -> index [R] int32 with probability w / sum(w);
    a row of w with no entry > 0 draws from fallback [R, V] instead (which has one; without a
    fallback every row of w must). `draw_noised(w, noise(keys, V), fallback)`: see there."""
    return draw_noised(w, noise(keys, w.shape[-1]), fallback)


def noise(keys, v: int):
    """The random numbers `draw_noised` takes for one draw per key [...] over V entries: on CPU one
    uniform per key [...], on a GPU one Gumbel per key and entry [..., V]. Made apart from the draw
    so that a program with several draws makes all of their noise in one kernel."""
    if compile_target.platform() == "cpu":
        return jax.vmap(jax.random.uniform)(keys.reshape(-1)).reshape(keys.shape)
    flat = keys.reshape(-1)
    g = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(flat)
    return g.reshape(*keys.shape, v)


def draw_noised(w, noise, fallback=None):
    """w [R, V] >= 0 and noise [R] or [R, V] (from `noise`) -> index [R] int32 with probability
    w / sum(w); a row of w with no entry > 0 draws from fallback [R, V] instead (which has one;
    without a fallback every row of w must). On CPU the inverse-CDF `draw` from one uniform per
    row; on a GPU a Gumbel-max draw, argmax(log w + G) with G iid Gumbel per token, one pass over
    the vocabulary instead of `draw`'s six kernels, with no normalising sum. The random numbers
    are free there; on a 2-core CPU V of them per row cost 20-40x the draw."""
    if compile_target.platform() == "cpu":
        if fallback is not None:
            w = jnp.where(jnp.sum(w, -1, keepdims=True) > 0, w, fallback)
        return draw(w, noise)
    score = lambda x: jnp.where(x > 0, jnp.log(x) + noise, -jnp.inf)
    if fallback is None:
        return argmax(score(w))
    # the fallback's scores sit FALLBACK_SHIFT below w's: w's are at least log(1e-45) + G >= -108
    # (G >= -4.5 from its uniform's smallest value, float32's smallest normal), the fallback's at
    # most 17 - FALLBACK_SHIFT, so a fallback token wins only in a row where w has none > 0
    return argmax(jnp.where(w > 0, score(w), score(fallback) - FALLBACK_SHIFT))


def argmax(x, axis: int = -1):
    """jnp.argmax(x, axis) as int32: the first maximal index, a NaN counting as maximal. On CPU two
    reductions that vectorise instead of jnp.argmax's one (value, index) reduction, which XLA:CPU runs
    an element at a time: over SmolLM2's 49,152 logits 27 against 212 us a row (2-core AMD EPYC).
    Elsewhere jnp.argmax itself (short_axis.row_argmax: one kernel on a GPU at any vocabulary size,
    where the two take five)."""
    if compile_target.platform() != "cpu":
        return row_argmax(jnp.moveaxis(x, axis, -1))
    return _cpu_max_argmax(x, axis % x.ndim)[1]


def max_argmax(x):
    """x [..., V] -> (the largest entry [...], `argmax(x)` [...]) at the cost of the argmax alone:
    on CPU argmax's own max, on a GPU its (value, index) reduction (short_axis.row_max_argmax).
    The largest is NaN where x holds a NaN."""
    if compile_target.platform() != "cpu":
        return row_max_argmax(x)
    m, idx = _cpu_max_argmax(x, x.ndim - 1)
    return m[..., 0], idx


def _cpu_max_argmax(x, axis: int):
    """argmax's CPU form along `axis`: (the max, kept as a size-1 axis; the first index holding it,
    or the first NaN)."""
    m = jnp.max(x, axis, keepdims=True)
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis, keepdims=True), nan, x == m)
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return m, jnp.min(jnp.where(hit, idx, x.shape[axis] - 1), axis)


def sample(logits, st: SamplingTensors, counts, seen, keys, sampled: bool | str = True):
    """logits [B, V] f32 -> tokens [B] int32. keys: typed PRNG keys [B] for this step.

    sampled (static): False when every row is greedy, so the program holds no sampler at all;
    TEMPERATURE_ONLY when no row filters; True handles any mix, greedy rows taking the argmax."""
    logits = apply_penalties(logits, st, counts, seen)
    greedy = argmax(logits)
    if not sampled:
        return greedy
    mixed = lambda: jnp.where(
        draws(st), draw_keyed(kept_weights(logits, st, sampled != TEMPERATURE_ONLY), keys), greedy
    )
    if skips_unused():  # no row draws: the draw is skipped
        return jax.lax.cond(jnp.any(draws(st)), mixed, lambda: greedy)
    return mixed()

"""Sampling: per-request parameters, their device form, penalties and the token sampler.

The same `sample` is used by plain decoding and by speculative verification, so both
see identical target distributions. All parameters are per-slot arrays: one compiled program
serves any mix of greedy and sampled requests.

Order (SGLang): penalties -> temperature -> top-k -> top-p -> min-p -> draw. temperature == 0 is greedy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, ClassVar

import jax
import jax.numpy as jnp
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from jaxspec.errors import JaxspecError

GREEDY_EPS = 1e-6


INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 32  # per request
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64  # before the per-engine limit (the server keeps a few stop-id columns per slot)


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
                    raise JaxspecError("n > 1 is not supported yet")
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

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int]) -> SamplingTensors:
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
        )

    @classmethod
    def build_default(cls, batch: int) -> SamplingTensors:
        """Greedy placeholders for `batch` empty slots."""
        return cls.build([SamplingParams(temperature=0.0)] * batch, [0] * batch)


def apply_penalties(logits, st: SamplingTensors, counts, seen):
    """logits [B, V] f32; counts [B, V] int32 (output tokens); seen [B, V] bool (prompt + output)."""
    rp = st.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - st.frequency_penalty[:, None] * counts
    return logits - st.presence_penalty[:, None] * (counts > 0)


def filtered_logits(logits, st: SamplingTensors):
    """Temperature-scaled logits with top-k/top-p/min-p applied, in descending-sorted order.

    Returns (sorted_logits [B, V] with -inf outside the kept set, sorted_ids [B, V])."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(st.temperature, GREEDY_EPS)[:, None]
    ids = jnp.argsort(-scaled, axis=-1)
    vals = jnp.take_along_axis(scaled, ids, axis=-1)
    probs = jax.nn.softmax(vals, axis=-1)
    rank = jnp.arange(v)[None, :]
    k = jnp.where(st.top_k > 0, st.top_k, v)[:, None]
    keep = rank < k
    keep &= (jnp.cumsum(probs, axis=-1) - probs) <= st.top_p[:, None]
    keep &= probs >= st.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    return jnp.where(keep, vals, -jnp.inf), ids


def target_probs(logits, st: SamplingTensors):
    """The distribution `sample` draws from, as probabilities over the vocabulary [B, V]."""
    vals, ids = filtered_logits(logits, st)
    p = jax.nn.softmax(vals, axis=-1)
    return jnp.zeros_like(p).at[jnp.arange(p.shape[0])[:, None], ids].set(p)


def sample(logits, st: SamplingTensors, counts, seen, keys):
    """logits [B, V] f32 -> tokens [B] int32. keys: typed PRNG keys [B] for this step."""
    logits = apply_penalties(logits, st, counts, seen)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = st.temperature <= GREEDY_EPS

    def draw():
        vals, ids = filtered_logits(logits, st)
        choice = jax.vmap(jax.random.categorical)(keys, vals)
        return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    drawn = jax.lax.cond(jnp.all(is_greedy), lambda: greedy, draw)
    return jnp.where(is_greedy, greedy, drawn)

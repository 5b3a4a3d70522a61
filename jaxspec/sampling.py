"""Sampling: per-request parameters, their device form, penalties and the token sampler.

The same `sample` is used by plain decoding and (issue 2) by speculative verification, so both
see identical target distributions. All parameters are per-slot arrays: one compiled program
serves any mix of greedy and sampled requests.

Order (SGLang): penalties -> temperature -> top-k -> top-p -> min-p -> draw. temperature == 0 is greedy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError

GREEDY_EPS = 1e-6


@dataclasses.dataclass
class SamplingParams:
    """Per-request parameters, named as in SGLang's `sampling_params` dict."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True

    ALIASES = {"sampling_seed": "seed", "max_tokens": "max_new_tokens"}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        if isinstance(d, SamplingParams):
            return d
        d = dict(d or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {}
        for k, v in d.items():
            k = cls.ALIASES.get(k, k)
            if k == "n":
                if v not in (None, 1):
                    raise JaxspecError("n > 1 is not supported yet")
                continue
            if k not in fields:
                raise JaxspecError(f"unknown sampling parameter {k!r}; known: {', '.join(sorted(fields))}")
            if v is not None:
                kw[k] = v
        p = cls(**kw)
        p.validate()
        return p

    def validate(self) -> None:
        def bad(msg):
            raise JaxspecError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 0:
            bad(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or self.top_k >= 1):
            bad(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and not isinstance(self.seed, (int, np.integer)):
            bad(f"seed must be an integer, got {self.seed!r}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


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
    def build(cls, params: list[SamplingParams], seeds: list[int]) -> "SamplingTensors":
        f32 = lambda name: jnp.asarray([getattr(p, name) for p in params], jnp.float32)  # noqa: E731
        return cls(
            temperature=f32("temperature"),
            top_k=jnp.asarray([max(p.top_k, 0) for p in params], jnp.int32),
            top_p=f32("top_p"),
            min_p=f32("min_p"),
            repetition_penalty=f32("repetition_penalty"),
            frequency_penalty=f32("frequency_penalty"),
            presence_penalty=f32("presence_penalty"),
            keys=jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32)),
        )


    @classmethod
    def build_default(cls, batch: int) -> "SamplingTensors":
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

"""Log-probabilities of tokens under the target model, computed inside the compiled programs.

The value reported for a token is log_softmax(logits / T) of the target at the position that
produced it, T the request's temperature (1 for greedy requests), before penalties and the
top-k / top-p / min-p filters: the model's own distribution at that temperature, as OpenAI and
SGLang report it. A token accepted from a draft gets the same value as if a plain step had
produced it: the verification pass computes the target's logits at every tree node, and the
accepted path's rows are the ones a plain step would have computed.

`TokenLogprobs` is carried by the decode / speculative states next to their `out` buffer (the
same columns), only when some request asked for logprobs: a state without it compiles to a
program without this work.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.sampling import GREEDY_EPS

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs; SGLang's top_logprobs_num is not capped


def top_k_for(vocab_size: int) -> int:
    """The alternatives the programs record per token: MAX_TOP_LOGPROBS (fewer for a smaller
    vocabulary); a request for fewer reads the first ones."""
    return min(MAX_TOP_LOGPROBS, vocab_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenLogprobs:
    """Per token: its log-probability and the K most likely tokens with theirs (K static, may be 0).
    Shapes [..., T] / [..., T, K]."""

    tok: jax.Array  # float32
    top_ids: jax.Array  # int32
    top_lp: jax.Array  # float32

    @classmethod
    def zeros(cls, shape: tuple[int, ...], k: int) -> TokenLogprobs:
        return cls(
            jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, k), jnp.int32), jnp.zeros((*shape, k), jnp.float32)
        )

    @property
    def k(self) -> int:
        return self.top_ids.shape[-1]

    def scatter(self, rows, cols, new: TokenLogprobs) -> TokenLogprobs:
        """self with new[b, t] written at [rows[b], cols[b, t]] (rows [B, 1], cols [B, T]); columns
        out of range are dropped, as `emit` drops tokens past a window."""
        put = lambda a, x: a.at[rows, cols].set(x, mode="drop")
        return TokenLogprobs(put(self.tok, new.tok), put(self.top_ids, new.top_ids), put(self.top_lp, new.top_lp))


def compute(logits, tokens, temperature, k: int) -> TokenLogprobs:
    """logits [B, ..., V] at the positions that produced tokens [B, ...]; temperature [B].
    Returns TokenLogprobs of shape [B, ...] (top-k over the vocabulary: lax.top_k, no sort)."""
    t = jnp.where(temperature <= GREEDY_EPS, 1.0, temperature).astype(jnp.float32)
    t = t.reshape((-1,) + (1,) * (logits.ndim - 1))
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    tok = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), -1)[..., 0]
    if k == 0:
        shape = tokens.shape + (0,)
        return TokenLogprobs(tok, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32))
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return TokenLogprobs(tok, top_ids.astype(jnp.int32), top_lp)

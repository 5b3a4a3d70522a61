"""STANDALONE: a small causal LM of the same tokenizer drafts for the target.

The draft keeps its own KV cache of x_0 .. x_{L-1}; x_L's KV is written at region column 0 each
round (not committed) and its logits are the root distribution. After verification the block
[x_L, accepted drafts..., bonus] is re-run: all but the bonus are committed, and the bonus becomes
the next round's root. With the target as its own draft every draft token is accepted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.decode import pick_rows
from jaxspec.errors import JaxspecError
from jaxspec.loader import jnp_dtype, load
from jaxspec.speculative.proposers.base import DraftState, Proposer, load_token_map


@dataclasses.dataclass(frozen=True, eq=False)
class StandaloneProposer(Proposer):
    def _logits(self, dparams, draft, h):
        head = dparams.get("head")
        return draft.logits(h) if head is None else (h @ head).astype(jnp.float32)

    def prefill_chunk(self, dparams, tgt, cache, tokens, feats, start, commit_lens):
        draft = nnx.merge(self.graphdef, dparams["draft"])
        b, c = tokens.shape
        cache = dataclasses.replace(cache, lengths=jnp.full((b,), start, jnp.int32))
        pos = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
        _, cache, _ = draft(tokens, pos, cache, backend=self.attention_backend)
        return dataclasses.replace(cache, lengths=jnp.minimum(commit_lens, start + c).astype(jnp.int32))

    def extend(self, dparams, tgt, state, tokens, feats, n_block, active):
        draft = nnx.merge(self.graphdef, dparams["draft"])
        cache = state.cache
        b, t = tokens.shape
        pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        h, cache, _ = draft(tokens, pos, cache, backend=self.extend_backend)
        root = jax.nn.softmax(self._logits(dparams, draft, pick_rows(h, n_block - 1)), -1)
        cache = dataclasses.replace(cache, lengths=cache.lengths + jnp.where(active, n_block - 1, 0))
        return DraftState(cache, jnp.where(active[:, None], root, state.root_probs), state.root_hidden)

    def step(self, dparams, tgt, state, tokens, hidden, depth, mask, offset):
        draft = nnx.merge(self.graphdef, dparams["draft"])
        pos = state.cache.lengths[:, None] + depth + jnp.zeros_like(tokens)
        h, cache, _ = draft(tokens, pos, state.cache, local_mask=mask, offset=offset, backend=self.attention_backend)
        return jax.nn.softmax(self._logits(dparams, draft, h), -1), None, dataclasses.replace(state, cache=cache)


def load_standalone(spec, target, dtype, progress=True):
    d = load(spec.draft_model_path, dtype, progress=progress, with_tokenizer=target.tokenizer is not None)
    if d.cfg.vocab_size != target.cfg.vocab_size:
        raise JaxspecError(
            f"STANDALONE draft {spec.draft_model_path} has vocab_size {d.cfg.vocab_size} but the target has "
            f"{target.cfg.vocab_size}; the draft must share the target's tokenizer"
        )
    if target.tokenizer is not None and d.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise JaxspecError(
            f"STANDALONE draft {spec.draft_model_path} uses a different tokenizer vocabulary than the target"
        )
    graphdef, params = nnx.split(d.model)
    dparams = {"draft": params}
    vocab = d.cfg.vocab_size
    if spec.token_map:
        ids = load_token_map(spec.token_map, d.cfg.vocab_size)
        w = d.model.head_weight()
        dparams["token_map"] = jnp.asarray(ids)
        dparams["head"] = jnp.asarray(w[:, ids], jnp_dtype(dtype))
        vocab = len(ids)
    return StandaloneProposer(graphdef, d.cfg, root_in_region=True, shift=0, draft_vocab=vocab), dparams

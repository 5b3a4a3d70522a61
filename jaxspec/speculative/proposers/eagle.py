"""EAGLE-1/2 and EAGLE-3 heads as proposers.

Draft entry p holds (token x_{p+1}, target feature h_p) at position p. Prefill writes entries
0 .. P-2 chunk by chunk; the extend after each verification (and once after prefill) writes
(accepted drafts + bonus, target features at the accepted nodes) and commits all of them. The
last entry's output gives the root distribution and the hidden fed to x_L's children.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from convert.sources import open_hf_dir
from jaxspec.decode import pick_rows
from jaxspec.errors import JaxspecError
from jaxspec.loader import jnp_dtype
from jaxspec.models.eagle import build_eagle, eagle3_capture_layers, eagle_config, eagle_key
from jaxspec.models.mtp import build_mtp, mtp_config, mtp_key, mtp_layout
from jaxspec.models.params import load_module
from jaxspec.speculative.proposers.base import DraftState, Proposer, load_token_map

logger = logging.getLogger("jaxspec")


@dataclasses.dataclass(frozen=True, eq=False)
class EagleProposer(Proposer):
    eagle3: bool = False

    def features(self, h, captured):
        if self.eagle3:  # [3, B, T, H] -> [B, T, 3H]
            return jnp.concatenate(list(captured), axis=-1)
        return h

    def _probs(self, dparams, tgt, head, lh):
        if self.eagle3:
            logits = head.logits(lh)
        elif "head" in dparams:
            logits = (lh @ dparams["head"]).astype(jnp.float32)
        else:
            logits = tgt.logits(lh)
        return jax.nn.softmax(logits, -1)

    def to_target(self, dparams, ids):
        if self.eagle3:
            return nnx.merge(self.graphdef, dparams["draft"]).to_target(ids)
        return super().to_target(dparams, ids)

    def _run(self, dparams, tgt, cache, tokens, hidden, pos, mask=None, offset=0):
        head = nnx.merge(self.graphdef, dparams["draft"])
        embeds = tgt.embed_tokens[...][tokens]
        lh, fb, cache = head(embeds, hidden, pos, cache, mask, offset, self.attention_backend)
        return head, lh, fb, cache

    def prefill_chunk(self, dparams, tgt, cache, tokens, feats, start, commit_lens):
        b, c = tokens.shape
        cache = dataclasses.replace(cache, lengths=jnp.full((b,), start, jnp.int32))
        pos = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
        _, _, _, cache = self._run(dparams, tgt, cache, tokens, feats, pos)
        return dataclasses.replace(cache, lengths=jnp.clip(commit_lens, 0, start + c).astype(jnp.int32))

    def extend(self, dparams, tgt, state, tokens, feats, n_block, active):
        cache = state.cache
        b, t = tokens.shape
        pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        head, lh, fb, cache = self._run(dparams, tgt, cache, tokens, feats, pos)
        root = self._probs(dparams, tgt, head, pick_rows(lh, n_block - 1))
        root_h = pick_rows(fb, n_block - 1).astype(state.root_hidden.dtype)
        cache = dataclasses.replace(cache, lengths=cache.lengths + jnp.where(active, n_block, 0))
        keep = active[:, None]
        return DraftState(cache, jnp.where(keep, root, state.root_probs), jnp.where(keep, root_h, state.root_hidden))

    def step(self, dparams, tgt, state, tokens, hidden, depth, mask, offset):
        pos = state.cache.lengths[:, None] + (depth - 1) + jnp.zeros_like(tokens)
        head, lh, fb, cache = self._run(dparams, tgt, state.cache, tokens, hidden, pos, mask, offset)
        return self._probs(dparams, tgt, head, lh), fb.astype(hidden.dtype), dataclasses.replace(state, cache=cache)


def _strip(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def load_eagle(spec, target, dtype, progress=True):
    path = spec.draft_model_path
    if not os.path.isdir(path):
        raise JaxspecError(f"EAGLE draft path must be a directory with config.json and weights: {path}")
    src = open_hf_dir(path, check_config=False)
    if spec.algorithm == "EAGLE":
        layout = mtp_layout(src.config, src.names)
        if layout is not None:
            return load_mtp(spec, target, dtype, src, layout, progress)
    kind, cfg, extra = eagle_config(src.config)
    if kind != spec.algorithm:
        want = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}[spec.algorithm]
        raise JaxspecError(f"speculative_algorithm={spec.algorithm} needs a {want} draft, but {path} is {kind}")
    if cfg.hidden_size != target.cfg.hidden_size:
        raise JaxspecError(f"draft hidden_size {cfg.hidden_size} != target hidden_size {target.cfg.hidden_size}")
    names = {_strip(n): n for n in src.names}
    jdt = jnp_dtype(dtype)
    ignore = lambda n: n in ("t2d", "embed_tokens.weight", "lm_head.weight") or n.endswith("rotary_emb.inv_freq")
    head = load_module(
        lambda: build_eagle(kind, cfg, extra, jdt, nnx.Rngs(0)),
        eagle_key,
        names,
        lambda n: src.get(names[n]),
        jdt,
        progress,
        desc=f"loading {os.path.basename(path.rstrip('/'))}",
        ignore=ignore,
    )
    graphdef, params = nnx.split(head)
    dparams = {"draft": params}
    eagle3 = kind == "EAGLE3"
    if eagle3:
        if spec.token_map:
            logger.warning("speculative_token_map is ignored for EAGLE3 (its draft vocabulary comes from d2t)")
        capture = eagle3_capture_layers(target.cfg, extra.get("aux_layer_ids"))
        vocab = extra["draft_vocab_size"]
    else:
        capture = ()
        vocab = target.cfg.vocab_size
        if spec.token_map:
            ids = load_token_map(spec.token_map, target.cfg.vocab_size)
            m = target.model
            w = m.embed_tokens[...].T if target.cfg.tie_word_embeddings else m.lm_head.kernel[...]
            dparams["token_map"] = jnp.asarray(ids)
            dparams["head"] = jnp.asarray(w[:, ids], jdt)
            vocab = len(ids)
    prop = EagleProposer(
        graphdef,
        cfg,
        root_in_region=False,
        shift=1,
        draft_vocab=vocab,
        capture_layers=capture,
        uses_hidden=True,
        eagle3=eagle3,
    )
    return prop, dparams


def load_mtp(spec, target, dtype, src, layout, progress=True):
    """An MTP module (DeepSeek NextN or MiMo layout) from `src` (the target's own checkpoint or a
    separate one) as an EAGLE-path proposer: target features are the final normed hidden, logits
    come from the target's LM head, multi-step drafting feeds the module's output back."""
    kind, prefix = layout
    cfg = mtp_config(src.config)
    if cfg.hidden_size != target.cfg.hidden_size:
        raise JaxspecError(f"MTP hidden_size {cfg.hidden_size} != target hidden_size {target.cfg.hidden_size}")
    if spec.token_map:
        logger.warning("speculative_token_map is ignored for MTP drafts")
    shared = (prefix + "embed_tokens.weight", prefix + "shared_head.head.weight")  # the target's own are used
    names = [n for n in src.names if n.startswith(prefix) and n not in shared]
    jdt = jnp_dtype(dtype)
    head = load_module(
        lambda: build_mtp(kind, cfg, jdt, nnx.Rngs(0)),
        mtp_key(prefix),
        names,
        src.get,
        jdt,
        progress,
        desc=f"loading the {kind} MTP module",
        ignore=lambda n: n.endswith("rotary_emb.inv_freq"),
    )
    graphdef, params = nnx.split(head)
    prop = EagleProposer(
        graphdef,
        cfg,
        root_in_region=False,
        shift=1,
        draft_vocab=target.cfg.vocab_size,
        capture_layers=(),
        uses_hidden=True,
        eagle3=False,
    )
    return prop, {"draft": params}

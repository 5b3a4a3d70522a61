"""EAGLE-1/2 and EAGLE-3 heads, and MTP modules, as proposers.

Draft entry p holds (token x_{p+1}, target feature h_p) at position p. Prefill writes entries
0 .. P-2 chunk by chunk; the extend after each verification (and once after prefill) writes
(accepted drafts + bonus, target features at the accepted nodes) and commits all of them. The
last entry's output gives the root distribution and the hidden fed to x_L's children.

Multi-layer MTP (MultiLayerMTPProposer): module j (1-based) at position p reads token x_{p+j}
and module j-1's output h^{j-1}_p (h^0 = the target's feature) and predicts x_{p+j+1}, as the
modules were trained. With x_L the last known token, module j holds entries for positions
p <= L - j: its committed length trails module 1's by j - 1. An extend over new tokens
x_{L+1} .. x_{L+T} runs every module over T rows: module j from position L - j + 1 on, all with
the same tokens. The draft is a chain (topk 1): step d runs module d + 1 over positions
L - d .. L - 1 with the chain's tokens x_{L+1} .. x_{L+d} = d_1 .. d_d, and its row at L - 1
gives d_{d+1}'s distribution. Module outputs h^j_p are kept per position in the draft cache
(layers D .. 2D - 2 after the D modules' KV layers), where module j + 1 reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.convert.sources import open_hf_dir
from jaxspec.decode import pick_rows
from jaxspec.errors import JaxspecError
from jaxspec.loader import jnp_dtype
from jaxspec.models.eagle import build_eagle, eagle3_capture_layers, eagle_config, eagle_key
from jaxspec.models.mtp import MTPStack, build_mtp, mtp_config, mtp_key, mtp_layouts
from jaxspec.models.params import load_module
from jaxspec.speculative.proposers.base import DraftState, Proposer, load_token_map

logger = logging.getLogger("jaxspec")


# The target features kept for online draft training: bfloat16, stored as their bits (uint16):
# XLA:CPU has no bfloat16 scatter and would convert the whole buffer to float32 and back at every
# write (two passes over hundreds of MB per round), while an integer scatter writes in place.
FEATURE_BITS = jnp.uint16


def unpack_features(bits):
    """Kept features as stored (uint16) -> bfloat16 (same shape)."""
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


@dataclasses.dataclass(frozen=True, eq=False)
class EagleProposer(Proposer):
    """keep_features (online draft training): the draft cache holds one more layer after the
    head's, whose keys [B, S, 1, F] keep each entry's target feature (the draft's input h_p at
    entry p, bfloat16 bits: FEATURE_BITS; values [B, S, 1, 1] unused), so that a finished
    request's features can be read back instead of recomputed by a second target forward."""

    eagle3: bool = False
    keep_features: bool = False

    @property
    def feature_layer(self) -> int:
        """The draft cache layer that keeps the target features (keep_features)."""
        return self.cfg.num_layers

    def make_cache(self, batch, max_len, dtype):
        cache = super().make_cache(batch, max_len, dtype)
        if not self.keep_features:
            return cache
        width = (len(self.capture_layers) or 1) * self.cfg.hidden_size
        feats = jnp.zeros((batch, max_len, 1, width), FEATURE_BITS)
        unused = jnp.zeros((batch, max_len, 1, 1), FEATURE_BITS)
        return dataclasses.replace(cache, k=cache.k + (feats,), v=cache.v + (unused,))

    def _keep(self, cache, feats, start):
        """Writes feats [B, T, F] at entries start + t of the feature layer (keep_features)."""
        if not self.keep_features:
            return cache
        bits = jax.lax.bitcast_convert_type(feats.astype(jnp.bfloat16), FEATURE_BITS)
        blank = jnp.zeros(feats.shape[:2] + (1, 1), FEATURE_BITS)
        return cache.write(self.feature_layer, bits[:, :, None, :], blank, start)

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

    def _run(self, dparams, tgt, cache, tokens, hidden, pos, mask=None, offset=0, backend=None):
        head = nnx.merge(self.graphdef, dparams["draft"])
        embeds = tgt.embed(tokens)
        lh, fb, cache = head(embeds, hidden, pos, cache, mask, offset, backend or self.attention_backend)
        return head, lh, fb, cache

    def prefill_chunk(self, dparams, tgt, cache, tokens, feats, start, commit_lens):
        b, c = tokens.shape
        cache = dataclasses.replace(cache, lengths=jnp.full((b,), start, jnp.int32))
        pos = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
        _, _, _, cache = self._run(dparams, tgt, cache, tokens, feats, pos)
        cache = self._keep(cache, feats, cache.lengths)
        return dataclasses.replace(cache, lengths=jnp.clip(commit_lens, 0, start + c).astype(jnp.int32))

    def extend(self, dparams, tgt, state, tokens, feats, n_block, active):
        cache = state.cache
        b, t = tokens.shape
        pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        head, lh, fb, cache = self._run(dparams, tgt, cache, tokens, feats, pos, backend=self.extend_backend)
        cache = self._keep(cache, feats, cache.lengths)
        root = self._probs(dparams, tgt, head, pick_rows(lh, n_block - 1))
        root_h = pick_rows(fb, n_block - 1).astype(state.root_hidden.dtype)
        cache = dataclasses.replace(cache, lengths=cache.lengths + jnp.where(active, n_block, 0))
        keep = active[:, None]
        return DraftState(cache, jnp.where(keep, root, state.root_probs), jnp.where(keep, root_h, state.root_hidden))

    def step(self, dparams, tgt, state, tokens, hidden, depth, mask, offset):
        pos = state.cache.lengths[:, None] + (depth - 1) + jnp.zeros_like(tokens)
        head, lh, fb, cache = self._run(dparams, tgt, state.cache, tokens, hidden, pos, mask, offset)
        return self._probs(dparams, tgt, head, lh), fb.astype(hidden.dtype), dataclasses.replace(state, cache=cache)


@dataclasses.dataclass(frozen=True, eq=False)
class MultiLayerMTPProposer(EagleProposer):
    """D MTP modules (an MTPStack), module j drafting the j-th token after the root (a chain).

    Draft cache: layers 0 .. D-1 hold module j's KV at layer j - 1; layers D .. 2D-2 hold module
    j's outputs h^j_p as keys [B, S, 1, H] at layer D + j - 1 (their values [B, S, 1, 1] unused).
    `lengths` is module 1's; module j's is max(lengths - (j - 1), 0)."""

    num_modules: int = 2

    def make_cache(self, batch, max_len, dtype):
        d, h = self.num_modules, self.cfg.hidden_size
        kv = KVCache.create(dataclasses.replace(self.cfg, num_layers=d), batch, max_len, dtype)
        outs = tuple(jnp.zeros((batch, max_len, 1, h), dtype) for _ in range(d - 1))
        unused = tuple(jnp.zeros((batch, max_len, 1, 1), dtype) for _ in range(d - 1))
        return dataclasses.replace(kv, k=kv.k + outs, v=kv.v + unused)

    def _module(self, dparams, tgt, cache, j: int, tokens, feats, frontier, backend=None):
        """Module j over T rows after module 1's frontier [B] (its committed length): rows at
        positions s + t, s = max(frontier - (j - 1), 0), with token x_{p+j} = tokens[p + j - 1 -
        frontier] (tokens [B, T] = x_{frontier+1} ..) and hidden h^{j-1}_p (feats [B, T, H] for
        j = 1, else module j-1's outputs in the cache). Writes the rows' KV (and outputs, j < D)
        at columns s + t. -> (outputs [B, T, H], s [B], cache)."""
        d = self.num_modules
        t = tokens.shape[1]
        s = jnp.maximum(frontier - (j - 1), 0)
        pos = s[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        toks = jnp.take_along_axis(tokens, jnp.clip(pos + (j - 1) - frontier[:, None], 0, t - 1), 1)
        if j == 1:
            hidden = feats
        else:
            buf = cache.read(d + j - 2)[0][:, :, 0]  # [B, S, H] module j-1's outputs
            hidden = jnp.take_along_axis(buf, jnp.clip(pos, 0, buf.shape[1] - 1)[:, :, None], 1)
        head = nnx.merge(self.graphdef, dparams["draft"]).heads[j - 1]
        embeds = tgt.embed(toks)
        lengths = cache.lengths
        c = dataclasses.replace(cache, lengths=s)
        out, _, c = head(embeds, hidden, pos, c, None, 0, backend or self.attention_backend, layer=j - 1)
        if j < d:
            c = c.write(d + j - 1, out[:, :, None, :], jnp.zeros(out.shape[:2] + (1, 1), out.dtype), s)
        return out, s, dataclasses.replace(c, lengths=lengths)

    def _all(self, dparams, tgt, cache, tokens, feats, frontier, backend=None):
        """Every module over the block; -> (module 1's outputs [B, T, H], cache)."""
        outs = []
        for j in range(1, self.num_modules + 1):
            out, _, cache = self._module(dparams, tgt, cache, j, tokens, feats, frontier, backend)
            outs.append(out)
        return outs[0], cache

    def prefill_chunk(self, dparams, tgt, cache, tokens, feats, start, commit_lens):
        b, c = tokens.shape
        _, cache = self._all(dparams, tgt, cache, tokens, feats, jnp.full((b,), start, jnp.int32))
        return dataclasses.replace(cache, lengths=jnp.clip(commit_lens, 0, start + c).astype(jnp.int32))

    def extend(self, dparams, tgt, state, tokens, feats, n_block, active):
        cache = state.cache
        out, cache = self._all(dparams, tgt, cache, tokens, feats, cache.lengths, self.extend_backend)
        last = pick_rows(out, n_block - 1)
        root = self._probs(dparams, tgt, None, last)
        cache = dataclasses.replace(cache, lengths=cache.lengths + jnp.where(active, n_block, 0))
        keep = active[:, None]
        root_h = last.astype(state.root_hidden.dtype)
        return DraftState(cache, jnp.where(keep, root, state.root_probs), jnp.where(keep, root_h, state.root_hidden))

    def step(self, dparams, tgt, state, tokens, hidden, depth, mask, offset):
        """tokens [B, 1]: d_depth (topk 1); runs module depth + 1 over the chain (mask, offset and
        hidden unused: the module reads module depth's outputs from the cache)."""
        chain = tokens if state.chain is None else jnp.concatenate([state.chain, tokens], 1)  # [B, depth]
        frontier = state.cache.lengths
        out, s, cache = self._module(dparams, tgt, state.cache, depth + 1, chain, None, frontier)
        row = pick_rows(out, frontier - 1 - s)[:, None]  # position L - 1
        probs = self._probs(dparams, tgt, None, row)
        return probs, row.astype(hidden.dtype), dataclasses.replace(state, cache=cache, chain=chain)


def _strip(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def load_eagle(spec, target, dtype, progress=True):
    path = spec.draft_model_path
    if not os.path.isdir(path):
        raise JaxspecError(f"EAGLE draft path must be a directory with config.json and weights: {path}")
    src = open_hf_dir(path, check_config=False)
    if spec.algorithm == "EAGLE":
        layouts = mtp_layouts(src.config, src.names)
        if layouts is not None:
            return load_mtp(spec, target, dtype, src, layouts, progress)
    if spec.multi_layer:
        raise JaxspecError(f"--enable-multi-layer-eagle needs a checkpoint with MTP layers; {path} has none")
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
            w = m.head_weight()
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


def load_mtp(spec, target, dtype, src, layouts, progress=True):
    """The MTP modules (DeepSeek NextN or MiMo layout) of `src` (the target's own checkpoint or a
    separate one) as an EAGLE-path proposer: target features are the final normed hidden, logits
    come from the target's LM head. Without spec.multi_layer the first module drafts every step,
    its output fed back; with it, module j drafts step j (MultiLayerMTPProposer)."""
    kind, prefixes = layouts
    cfg = mtp_config(src.config)
    if cfg.hidden_size != target.cfg.hidden_size:
        raise JaxspecError(f"MTP hidden_size {cfg.hidden_size} != target hidden_size {target.cfg.hidden_size}")
    if spec.token_map:
        logger.warning("speculative_token_map is ignored for MTP drafts")
    if spec.multi_layer and spec.num_steps > len(prefixes):
        raise JaxspecError(
            f"--enable-multi-layer-eagle drafts one token per MTP layer: speculative_num_steps={spec.num_steps} "
            f"asks for more than the {len(prefixes)} MTP layer(s) of {spec.draft_model_path}"
        )
    if not spec.multi_layer and len(prefixes) > 1:
        logger.info(
            "%s has %d MTP layers; the first drafts every step (--enable-multi-layer-eagle: one layer per step)",
            spec.draft_model_path,
            len(prefixes),
        )
    jdt = jnp_dtype(dtype)
    used = prefixes[: spec.num_steps] if spec.multi_layer else prefixes[:1]

    def load(prefix):
        shared = (prefix + "embed_tokens.weight", prefix + "shared_head.head.weight")  # the target's own are used
        return load_module(
            lambda: build_mtp(kind, cfg, jdt, nnx.Rngs(0)),
            mtp_key(prefix),
            [n for n in src.names if n.startswith(prefix) and n not in shared],
            src.get,
            jdt,
            progress,
            desc=f"loading the {kind} MTP module" + (f" {prefix}" if len(used) > 1 else ""),
            ignore=lambda n: n.endswith("rotary_emb.inv_freq"),
        )

    common = dict(root_in_region=False, shift=1, draft_vocab=target.cfg.vocab_size, uses_hidden=True)
    if spec.multi_layer:
        graphdef, params = nnx.split(MTPStack([load(p) for p in used]))
        return MultiLayerMTPProposer(graphdef, cfg, num_modules=len(used), **common), {"draft": params}
    graphdef, params = nnx.split(load(used[0]))
    return EagleProposer(graphdef, cfg, **common), {"draft": params}

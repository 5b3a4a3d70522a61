"""EAGLE draft heads in the public (SGLang / SafeAILab) checkpoint layouts.

EAGLE-1/2 (`LlamaForCausalLMEagle`): fc Linear(2H -> H, bias) on concat(embed(x), hidden), then one
Llama decoder layer without input_layernorm, no final norm; embedding and LM head are the target's.
The target hidden it consumes is the target's final (normed) hidden state; its output hidden is
fed back as the next step's hidden.

EAGLE-3 (`LlamaForCausalLMEagle3`): the target's residual streams at the inputs of three layers,
concatenated (3H), go through fc Linear(3H -> H); `midlayer` normalises embeds (input_layernorm) and
hidden (hidden_norm) separately and attends over their concat (2H); residual = hidden; then
post_attention_layernorm + MLP; logits = lm_head(norm(out + residual)) over `draft_vocab_size`
ids, mapped to target ids by `d2t` (target = d + d2t[d]). The pre-norm sum (out + residual) is fed
back as the next step's hidden. Embedding shared from the target.

Checkpoint keys (an optional "model." prefix is stripped):
  EAGLE-1/2: fc.weight, fc.bias, layers.0.{self_attn,mlp}.*, layers.0.post_attention_layernorm.weight
  EAGLE-3:   fc.weight, midlayer.{input_layernorm,hidden_norm,self_attn,post_attention_layernorm,mlp}.*,
             norm.weight, lm_head.weight, d2t (t2d and embed_tokens.weight are ignored)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.config import EAGLE_ARCHS, ModelConfig, rope_inv_freq
from jaxspec.errors import JaxspecError
from jaxspec.models import fused_layer
from jaxspec.models.llama import MLP, Attention, DecoderLayer, Linear, RMSNorm


def eagle_config(d: dict) -> tuple[str, ModelConfig, dict]:
    """(kind "EAGLE" | "EAGLE3", ModelConfig of the draft layer, extra) from a draft config.json."""
    arch = (d.get("architectures") or ["?"])[0]
    if arch not in EAGLE_ARCHS:
        raise JaxspecError(
            f"not an EAGLE draft config: architectures={d.get('architectures')}; expected one of {', '.join(EAGLE_ARCHS)}"
        )
    kind = EAGLE_ARCHS[arch]
    cfg = ModelConfig.from_hf(
        {**d, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    )
    extra = {"draft_vocab_size": d.get("draft_vocab_size") or d["vocab_size"]}
    ec = d.get("eagle_config") or {}
    if ec.get("eagle_aux_hidden_state_layer_ids"):
        extra["aux_layer_ids"] = tuple(ec["eagle_aux_hidden_state_layer_ids"])
    return kind, cfg, extra


def eagle3_capture_layers(target: ModelConfig, aux_layer_ids: tuple | None = None) -> tuple[int, ...]:
    """Target layers whose *inputs* EAGLE-3 consumes: [2, N//2, N-3], or the config's ids + 1."""
    n = target.num_layers
    layers = tuple(i + 1 for i in aux_layer_ids) if aux_layer_ids else (2, n // 2, n - 3)
    if len(layers) != 3 or len(set(layers)) != 3 or min(layers) < 0 or max(layers) > n:
        raise JaxspecError(f"EAGLE-3 needs three distinct target layers in [0, {n}], got {layers}")
    return layers


class Eagle2Head(nnx.Module):
    kind = "EAGLE"

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(cfg, dtype, rngs, input_norm=False)

    def __call__(self, embeds, hidden, positions, cache: KVCache, local_mask=None, offset=0, backend="xla"):
        """embeds, hidden: [B, T, H] -> (draft hidden [B, T, H] for the target LM head and feedback, cache)."""
        x = self.fc(jnp.concatenate([embeds, hidden.astype(embeds.dtype)], -1))
        inv_freq = jnp.asarray(rope_inv_freq(self.cfg))
        x, cache = self.layer(x, positions, inv_freq, cache, 0, local_mask, offset, backend)
        return x, x, cache


class Eagle3Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, in_dim=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)


class Eagle3Head(nnx.Module):
    kind = "EAGLE3"

    def __init__(self, cfg: ModelConfig, draft_vocab_size: int, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(3 * h, h, bias=False, dtype=dtype, rngs=rngs)
        self.midlayer = Eagle3Layer(cfg, dtype, rngs)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(h, draft_vocab_size, bias=False, dtype=dtype, rngs=rngs)
        self.d2t = nnx.Variable(jnp.zeros((draft_vocab_size,), jnp.int32))

    def __call__(self, embeds, hidden, positions, cache: KVCache, local_mask=None, offset=0, backend="xla"):
        """embeds: [B, T, H]; hidden: [B, T, 3H] (target features) or [B, T, H] (fed back).
        Returns (normed hidden [B, T, H] for lm_head, pre-norm hidden to feed back, cache)."""
        inv_freq = jnp.asarray(rope_inv_freq(self.cfg))
        if fused_layer.eagle3_applies(self, embeds.shape[0] * embeds.shape[1], backend, cache):  # a GPU: kernels
            return fused_layer.run_eagle3(self, embeds, hidden, positions, inv_freq, cache, local_mask, offset, backend)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden.astype(embeds.dtype))
        hidden = hidden.astype(embeds.dtype)
        m = self.midlayer
        x = jnp.concatenate([m.input_layernorm(embeds), m.hidden_norm(hidden)], -1)
        a, cache = m.self_attn(x, positions, inv_freq, cache, 0, local_mask, offset, backend)
        residual = a + hidden
        out = m.mlp(m.post_attention_layernorm(residual)) + residual
        return self.norm(out), out, cache

    def logits(self, h):
        return self.lm_head(h).astype(jnp.float32)  # int8 under w8a8_int8 (jaxspec/quant.py)

    def to_target(self, ids):
        return ids + self.d2t[...][ids]


def eagle_key(path: tuple) -> tuple[str, bool]:
    """NNX path of an EAGLE head -> (checkpoint key, transpose?)."""
    parts = [str(p) for p in path]
    transpose = parts[-1] == "kernel"
    if transpose:
        parts[-1] = "weight"
    if parts[0] == "layer":
        parts[0] = "layers.0"
    return ".".join(parts), transpose


def build_eagle(kind: str, cfg: ModelConfig, extra: dict, dtype, rngs: nnx.Rngs):
    if kind == "EAGLE":
        return Eagle2Head(cfg, dtype, rngs=rngs)
    return Eagle3Head(cfg, extra["draft_vocab_size"], dtype, rngs=rngs)

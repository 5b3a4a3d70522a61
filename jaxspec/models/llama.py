"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5) in Flax NNX.

GQA, RoPE with default / linear / llama3 scaling, optional q/k/v (and o) bias, tied or untied
embeddings, float32 / bfloat16 / float16 parameters (norms and softmax in float32).

Shapes: B batch, T new tokens, S cache length, H hidden, Nh heads, Nkv kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.attention import attention
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig, rope_inv_freq

INIT_STD = 0.02


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (HF weights are [out, in], transposed on load)."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (din, dout), dtype) * INIT_STD)
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x):
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(x.dtype) * self.weight[...]


def apply_rope(x, positions, inv_freq):
    """x: [B, T, N, D]; positions: [B, T]; inv_freq: [D/2]. Rotate-half convention (HF)."""
    ang = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, in_dim: int | None = None):
        h, d = in_dim or cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.cfg = cfg

    def __call__(self, x, positions, inv_freq, cache: KVCache, layer: int, local_mask, offset, backend):
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        cache = cache.write(layer, k, v, cache.lengths + offset)
        o = attention(
            q, *cache.read(layer), cache.lengths, local_mask, cfg.sliding_window, offset, backend, cache.sharding
        )
        return self.o_proj(o.reshape(b, t, cfg.num_heads * cfg.head_dim)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, input_norm: bool = True):
        # EAGLE-1/2 draft layers have no input_layernorm.
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if input_norm else None
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, inv_freq, cache, layer, local_mask, offset, backend):
        xn = x if self.input_layernorm is None else self.input_layernorm(x)
        a, cache = self.self_attn(xn, positions, inv_freq, cache, layer, local_mask, offset, backend)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaForCausalLM(nnx.Module):
    """Module paths mirror HF key names (`model.layers.3.self_attn.q_proj.weight` ->
    `layers[3].self_attn.q_proj.kernel`), see `jaxspec.models.params`."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype) * INIT_STD
        )
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )

    def __call__(
        self,
        tokens,  # [B, T] int32
        positions,  # [B, T] int32 (RoPE positions; = cache column for plain decoding)
        cache: KVCache,  # new KV written at cache.lengths[b] + offset + t; lengths are NOT advanced here
        local_mask=None,  # [B, T, W] bool over the region from cache.lengths (see attention.py); None = causal
        capture_layers: tuple[int, ...] = (),
        backend: str = "xla",
        offset=0,  # int32 scalar: where the new tokens start inside the local region
    ):
        """Returns (hidden [B, T, H] after the final norm, cache, captured [len(capture_layers), B, T, H]).

        `captured[j]` is the residual stream at the *input* of layer capture_layers[j]
        (EAGLE-3 takes three of them); capture index num_layers is the pre-norm output."""
        inv_freq = jnp.asarray(rope_inv_freq(self.cfg))
        x = self.embed_tokens[...][tokens]
        captured = []
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                captured.append(x)
            x, cache = layer(x, positions, inv_freq, cache, i, local_mask, offset, backend)
        if self.cfg.num_layers in capture_layers:
            captured.append(x)
        h = self.norm(x)
        cap = jnp.stack(captured) if captured else None
        return h, cache, cap

    def logits(self, h):
        """h: [..., H] -> float32 logits [..., V]."""
        if self.lm_head is None:
            w = self.embed_tokens[...]
            return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=jnp.float32)
        return (h @ self.lm_head.kernel[...]).astype(jnp.float32)

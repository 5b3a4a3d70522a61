"""A decoder layer's few-row work as five GPU kernels (the Pallas attention backend).

With the "pallas" attention backend (a GPU), a DecoderLayer whose rows (B * T: a decoding step, a
draft step, a verification tree) are few runs each projection with what surrounds it folded in
(jaxspec/pallas_kernels/rows_matmul.py), around the attention kernel:

    RMSNorm + q/k/v + RoPE + KV write | attention | o + residual | RMSNorm + gate/up | SwiGLU + down + residual

where XLA:GPU launched about sixteen: it rewrites such small matmuls into a product and a
reduction kernel each, and adds one per norm, one for q's RoPE, a scatter each for K and V, and a
pad and a merge around the attention kernel. The result is the unfused layer's up to float rounding
(float32 accumulation in both). The unfused path stays for everything else: weights quantized,
laid out for several tensor-parallel shards or out-major; rows not a power of two up to 64;
dimensions not multiples of the kernels' blocks; projections larger than MAX_WEIGHT; layers
with per-head q/k norms (Qwen3), which the q/k/v kernel does not apply before its RoPE; and layers
with a mixture-of-experts block (Qwen3-MoE, models/moe.py) in place of the MLP.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxspec import compile_target
from jaxspec.attention import attention, whole_buffers
from jaxspec.pallas_kernels import rows_matmul as _rm

# The largest projection (inputs x outputs) fused: below about ten million multiply-adds a row,
# XLA:GPU turns a matmul into a product and a reduction (two launches, and the product written out);
# above it, it calls a GEMM that streams the weight at memory bandwidth, which these kernels are
# not tuned to beat (Llama-3.1-8B's projections are 17-59 million).
MAX_WEIGHT = 10_000_000


def _plain(lin: Any) -> bool:
    return lin.scale is None and lin.gguf is None and not lin.act_int8 and not lin.out_major


def _takes(attn: Any, mlp: Any, rows: int, backend: str, cache: Any) -> bool:
    """Whether an attention + MLP pair runs fused for `rows` rows on `backend` with `cache`."""
    if not backend.startswith("pallas") or cache.sharding is not None:
        return False
    if getattr(mlp, "is_moe", False):  # a mixture of experts (models/moe.py): unfused
        return False
    if attn.shards != 1 or mlp.shards != 1 or attn.cfg.head_dim % 2:
        return False
    if attn.q_norm is not None:  # Qwen3's q/k norms come between the projection and RoPE: unfused
        return False
    # q/k/v runs one program per head (block_n = D), the others BLOCK_N columns a program
    blocks = [(attn.qkv_proj, attn.cfg.head_dim)] + [
        (lin, _rm.BLOCK_N) for lin in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ]
    return all(_fits(lin, rows, block_n, cache.k[0].dtype) for lin, block_n in blocks)


def _fits(lin: Any, rows: int, block_n: int, dtype) -> bool:
    k, n = lin.kernel.shape
    if not _plain(lin) or lin.kernel.dtype != dtype or k * n > MAX_WEIGHT:
        return False
    return _rm.supported(rows, k, n, _rm.default_block_k(rows, k), block_n)


def applies(layer: Any, rows: int, backend: str, cache: Any) -> bool:
    """Whether `layer` (a DecoderLayer) runs fused for `rows` rows on `backend` with `cache`."""
    return layer.input_layernorm is not None and _takes(layer.self_attn, layer.mlp, rows, backend, cache)


def eagle3_applies(head: Any, rows: int, backend: str, cache: Any) -> bool:
    """Whether an EAGLE-3 head (models/eagle.py Eagle3Head) runs its layer fused for `rows` rows."""
    m = head.midlayer
    return _takes(m.self_attn, m.mlp, rows, backend, cache) and _fits(head.fc, rows, _rm.BLOCK_N, cache.k[0].dtype)


def _mm(x, lin, **kw):
    bias = None if lin.bias is None else lin.bias[...]
    interpret = compile_target.platform() != "gpu"
    return _rm.rows_matmul(x, lin.kernel[...], bias=bias, interpret=interpret, **kw)


def _attention_in(attn: Any, norm: Any, rows, positions, inv_freq, cache, idx: int, offset):
    """RMSNorm (norm None: none), q/k/v, RoPE and the KV write as one kernel: rows [M = B * T, Hin] ->
    (q [B, T, Nh, D], cache)."""
    cfg, (b, t) = attn.cfg, positions.shape
    slot = jnp.broadcast_to(cache.slots(b)[:, None], (b, t)).reshape(-1)
    col = ((cache.lengths + offset)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]).reshape(-1)
    lin = attn.qkv_proj
    q, k, v = _rm.qkv_rope_write(
        rows,
        lin.kernel[...],
        None if norm is None else norm.weight[...],
        None if lin.bias is None else lin.bias[...],
        positions.reshape(-1).astype(jnp.int32),
        inv_freq,
        cache.k[idx],
        cache.v[idx],
        slot.astype(jnp.int32),
        col.astype(jnp.int32),
        nh=cfg.num_heads,
        nkv=cfg.num_kv_heads,
        eps=1e-6 if norm is None else norm.eps,
        interpret=compile_target.platform() != "gpu",
    )
    return q.reshape(b, t, cfg.num_heads, cfg.head_dim), cache.with_layer(idx, k, v)


def _block(layer: Any, x_in, residual, positions, inv_freq, cache, idx: int, local_mask, offset, backend, norm):
    """Attention and MLP with their residuals: x_in [M, Hin] (normed by `norm` in the q/k/v kernel
    unless None), residual [M, H] -> (out [M, H], cache)."""
    attn, mlp, cfg = layer.self_attn, layer.mlp, layer.self_attn.cfg
    q, cache = _attention_in(attn, norm, x_in, positions, inv_freq, cache, idx, offset)
    k, v = cache.read(idx, whole=whole_buffers(backend, cache))
    o = attention(q, k, v, cache.lengths, local_mask, cfg.sliding_window, offset, backend, cache.sharding)
    rows = _mm(o.reshape(x_in.shape[0], -1), attn.o_proj, residual=residual)
    post = layer.post_attention_layernorm
    gu = _mm(rows, mlp.gate_up_proj, norm_w=post.weight[...], prologue="rmsnorm", eps=post.eps)
    return _mm(gu, mlp.down_proj, residual=rows, prologue="swiglu"), cache


def run(layer: Any, x, positions, inv_freq, cache, idx: int, local_mask, offset, backend):
    """The layer's forward (DecoderLayer.__call__'s contract): x [B, T, H] -> (x [B, T, H], cache)."""
    b, t, h = x.shape
    rows = x.reshape(b * t, h)
    out, cache = _block(
        layer, rows, rows, positions, inv_freq, cache, idx, local_mask, offset, backend, layer.input_layernorm
    )
    return out.reshape(b, t, h), cache


def run_eagle3(head: Any, embeds, hidden, positions, inv_freq, cache, local_mask, offset, backend):
    """Eagle3Head.__call__'s contract, its layer fused: embeds [B, T, H], hidden [B, T, 3H] or [B, T, H]
    -> (normed hidden [B, T, H], pre-norm hidden [B, T, H], cache). The two input norms and their
    concatenation stay XLA's (one fusion); fc, q/k/v (+ RoPE + KV write), o, gate/up, down are
    the kernels."""
    b, t, h = embeds.shape
    hidden = hidden.reshape(b * t, -1).astype(embeds.dtype)
    if hidden.shape[-1] != h:
        hidden = _mm(hidden, head.fc)
    m = head.midlayer
    x = jnp.concatenate([m.input_layernorm(embeds.reshape(b * t, h)), m.hidden_norm(hidden)], -1)
    out, cache = _block(m, x, hidden, positions, inv_freq, cache, 0, local_mask, offset, backend, None)
    out = out.reshape(b, t, h)
    return head.norm(out), out, cache

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
dimensions not multiples of the kernels' blocks; and projections larger than MAX_WEIGHT.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxspec import compile_target
from jaxspec.attention import attention
from jaxspec.pallas_kernels import rows_matmul as _rm

# The largest projection (inputs x outputs) fused: below about ten million multiply-adds a row,
# XLA:GPU turns a matmul into a product and a reduction (two launches, and the product written out);
# above it, it calls a GEMM that streams the weight at memory bandwidth, which these kernels are
# not tuned to beat (Llama-3.1-8B's projections are 17-59 million).
MAX_WEIGHT = 10_000_000


def _plain(lin: Any) -> bool:
    return lin.scale is None and lin.gguf is None and not lin.act_int8 and not lin.out_major


def applies(layer: Any, rows: int, backend: str, cache: Any) -> bool:
    """Whether `layer` (a DecoderLayer) runs fused for `rows` rows on `backend` with `cache`."""
    attn, mlp = layer.self_attn, layer.mlp
    if not backend.startswith("pallas") or cache.sharding is not None or layer.input_layernorm is None:
        return False
    if attn.shards != 1 or mlp.shards != 1 or attn.cfg.head_dim % 2:
        return False
    # q/k/v runs one program per head (block_n = D), the others BLOCK_N columns a program
    blocks = [(attn.qkv_proj, attn.cfg.head_dim)] + [
        (lin, _rm.BLOCK_N) for lin in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ]
    for lin, block_n in blocks:
        k, n = lin.kernel.shape
        if not _plain(lin) or lin.kernel.dtype != cache.k[0].dtype or k * n > MAX_WEIGHT:
            return False
        if not _rm.supported(rows, k, n, _rm.default_block_k(rows, k), block_n):
            return False
    return True


def _mm(x, lin, **kw):
    bias = None if lin.bias is None else lin.bias[...]
    interpret = compile_target.platform() != "gpu"
    return _rm.rows_matmul(x, lin.kernel[...], bias=bias, interpret=interpret, **kw)


def _attention_in(attn: Any, norm: Any, rows, positions, inv_freq, cache, idx: int, offset):
    """RMSNorm, q/k/v, RoPE and the KV write as one kernel: rows [M = B * T, H] -> (q [B, T, Nh, D], cache)."""
    cfg, (b, t) = attn.cfg, positions.shape
    slot = jnp.broadcast_to(cache.slots(b)[:, None], (b, t)).reshape(-1)
    col = ((cache.lengths + offset)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]).reshape(-1)
    lin = attn.qkv_proj
    q, k, v = _rm.qkv_rope_write(
        rows,
        lin.kernel[...],
        norm.weight[...],
        None if lin.bias is None else lin.bias[...],
        positions.reshape(-1).astype(jnp.int32),
        inv_freq,
        cache.k[idx],
        cache.v[idx],
        slot.astype(jnp.int32),
        col.astype(jnp.int32),
        nh=cfg.num_heads,
        nkv=cfg.num_kv_heads,
        eps=norm.eps,
        interpret=compile_target.platform() != "gpu",
    )
    return q.reshape(b, t, cfg.num_heads, cfg.head_dim), cache.with_layer(idx, k, v)


def run(layer: Any, x, positions, inv_freq, cache, idx: int, local_mask, offset, backend):
    """The layer's forward (DecoderLayer.__call__'s contract): x [B, T, H] -> (x [B, T, H], cache)."""
    attn, mlp, cfg = layer.self_attn, layer.mlp, layer.self_attn.cfg
    b, t, h = x.shape
    rows = x.reshape(b * t, h)
    q, cache = _attention_in(attn, layer.input_layernorm, rows, positions, inv_freq, cache, idx, offset)
    k, v = cache.read(idx)
    o = attention(q, k, v, cache.lengths, local_mask, cfg.sliding_window, offset, backend, cache.sharding)
    rows = _mm(o.reshape(b * t, -1), attn.o_proj, residual=rows)
    post = layer.post_attention_layernorm
    gu = _mm(rows, mlp.gate_up_proj, norm_w=post.weight[...], prologue="rmsnorm", eps=post.eps)
    rows = _mm(gu, mlp.down_proj, residual=rows, prologue="swiglu")
    return rows.reshape(b, t, h), cache

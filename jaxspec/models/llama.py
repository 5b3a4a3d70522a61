"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3 dense and MoE) in Flax NNX.

GQA, RoPE with default / linear / llama3 scaling, optional q/k/v (and o) bias, optional per-head
RMSNorm of q and k before RoPE (Qwen3: q_norm, k_norm), tied or untied embeddings, float32 /
bfloat16 / float16 parameters (norms and softmax in float32). Qwen3-MoE's sparse layers have a
mixture-of-experts block (models/moe.py) where the others have the MLP.

Checkpoints, conversion and training see the HF layout (separate q/k/v_proj and gate/up_proj);
inference engines call `fuse_projections` once after loading, so that a layer runs one q/k/v matmul
(qkv_proj) and one gate/up matmul (gate_up_proj). The fused columns are laid out shard-major for tp
tensor-parallel shards, [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...], so that a plain column split
gives each device its own heads' q, k and v (and its own gate and up columns).

On XLA:CPU, inference engines also call `out_major`: kernels stored [out, in], so that a matmul of a
few rows (a verification tree, a batch of decoding slots) runs as one multiply-and-reduce pass over
the weights instead of a GEMM that packs them (2-3x the time of a one-row matrix-vector product).

Shapes: B batch, T new tokens, S cache length, H hidden, Nh heads, Nkv kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxspec import compile_target, gguf, native
from jaxspec.attention import attention, whole_buffers
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig, rope_inv_freq
from jaxspec.errors import JaxspecError
from jaxspec.models import fused_layer
from jaxspec.models.moe import SparseMoeBlock

INIT_STD = 0.02


# Up to this many rows, an out-major Linear multiplies by a multiply-and-reduce pass (see out_major).
SMALL_ROWS = 32


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (HF weights are [out, in], transposed on load),
    or [out, in] once `out_major` has run (self.out_major).
    Quantized (jaxspec/quant.py): kernel int8 / float8 and scale [out], y = (x @ kernel) * scale;
    with self.act_int8 (w8a8_int8) x is quantized too, per token, and the matmul runs in integers.
    With self.gguf (a GGUF block type, jaxspec/gguf.py): kernel is a GGUF file's blocks [out, in / 32
    * block bytes] uint8, multiplied as stored."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (din, dout), dtype) * INIT_STD)
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None
        self.scale: Any = None  # an nnx.Param once quantized
        self.out_major = False
        self.act_int8 = False
        self.gguf: str | None = None

    def __call__(self, x, norm: RMSNorm | None = None):
        """x [..., I] -> [..., O]; norm: an RMSNorm applied to x first (inside the native kernel under
        GGUF blocks)."""
        w = self.kernel[...]
        if self.gguf is not None:
            y = gguf.matmul(x, w, self.gguf, None if norm is None else (norm.weight[...], norm.eps))
            return y if self.bias is None else y + self.bias[...]
        if norm is not None:
            x = norm(x)
        if self.act_int8:
            y = int8_matmul(x, w, self.scale[...], self.out_major)
            return y if self.bias is None else y + self.bias[...]
        if self.scale is not None:  # quantized weight: converted to x's dtype, then scaled per output column
            w = w.astype(x.dtype)
        y = small_rows_matmul(x, w) if self.out_major else x @ w
        if self.scale is not None:
            y = y * self.scale[...].astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]

    @staticmethod
    def joinable(parts: list[Linear]) -> bool:
        """Whether `concat` can join `parts`: all float, or all GGUF blocks of one type."""
        return len({p.gguf for p in parts}) == 1

    @classmethod
    def concat(cls, parts: list[Linear], shards: int) -> Linear:
        """One Linear computing all of `parts` (same input) at once; output columns shard-major
        (GGUF blocks, stored out-major: their rows joined, for one shard)."""
        k0, biases = parts[0].kernel[...], [p.bias[...] for p in parts if p.bias is not None]
        dtype = jnp.float32 if parts[0].gguf is not None else k0.dtype  # (the kernel is replaced below)
        lin = nnx.eval_shape(lambda: cls(k0.shape[0], 1, bias=bool(biases), dtype=dtype, rngs=nnx.Rngs(0)))
        if parts[0].gguf is not None:
            lin.kernel = nnx.Param(jnp.concatenate([p.kernel[...] for p in parts]))
            lin.gguf, lin.out_major = parts[0].gguf, True
        else:
            lin.kernel = nnx.Param(concat_shards([p.kernel[...] for p in parts], shards))
        if biases:
            lin.bias = nnx.Param(concat_shards(biases, shards))
        return lin


def concat_shards(ws: list, shards: int):
    """ws: arrays [..., C_i] -> [..., sum C_i] with columns [w0_0 | w1_0 | ... | w0_1 | w1_1 | ...]:
    block s holds the s-th of `shards` equal column slices of every w (split like ws[0] on a mesh)."""
    sharding = getattr(ws[0], "sharding", None)  # (none under jax.eval_shape: the weights are shapes)
    return _concat_shards(ws, shards, sharding if isinstance(sharding, NamedSharding) else None)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _concat_shards(ws, shards, sharding):
    lead = ws[0].shape[:-1]
    out = jnp.concatenate([w.reshape(*lead, shards, -1) for w in ws], -1).reshape(*lead, -1)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def small_rows_matmul(x, w, out_dtype=None):
    """x [..., I] times an out-major weight w [O, I] of x's dtype -> [..., O] in out_dtype (x.dtype).

    From 2 to SMALL_ROWS rows: an elementwise product summed over I in float32, which XLA:CPU fuses
    into one pass that reads w once, as a one-row matrix-vector product does. Its GEMM, which packs
    the weight, costs 2-3x that for 3-8 rows (benchmarks/RESULTS.md). Otherwise a plain matmul."""
    out_dtype = out_dtype or x.dtype
    rows = math.prod(x.shape[:-1])
    if rows < 2 or rows > SMALL_ROWS:
        return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=out_dtype)
    prod = w[:, None, :].astype(jnp.float32) * x.reshape(rows, -1)[None].astype(jnp.float32)
    return jnp.sum(prod, -1).T.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype)


def int8_matmul(x, w, w_scale, out_major: bool = False):
    """x [..., I] float times an int8 weight w [I, O] (out_major: [O, I]) with per-column scales
    w_scale [O] -> [..., O] in x's dtype, as w8a8_int8 runs it: each row of x is quantized to int8
    with its own scale (max |x| / 127), the product is accumulated exactly in int32 (|sum| <=
    I * 127^2 < 2^31 for I < 133000), then scaled by both. The integer product does not depend on
    how rows are batched, so a token gets the same output alone, in a batch or in a verification tree.

    Out-major weights (XLA:CPU with the native kernel, see out_major) multiply up to SMALL_ROWS rows
    by `jaxspec.native.int8_matmul`, more rows by XLA's int8 GEMM. In-major ones by XLA's int8 dot,
    with one row padded to two: XLA:CPU rewrites a one-row int8 dot into a multiply-and-reduce that
    is 10x slower than its int8 GEMM (benchmarks/RESULTS.md)."""
    lead, rows = x.shape[:-1], math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    native_rows = out_major and rows <= SMALL_ROWS
    if rows == 1 and not native_rows:
        x2 = jnp.concatenate([x2, x2])
    amax = jnp.max(jnp.abs(x2), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x2 / x_scale), -127, 127).astype(jnp.int8)
    if native_rows:
        acc = native.int8_matmul(xq, w)
    elif out_major:
        acc = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    else:
        acc = jax.lax.dot(xq, w, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * x_scale * w_scale.astype(jnp.float32)
    return y[:rows].reshape(*lead, acc.shape[-1]).astype(x.dtype)


def split_shards(y, shards: int, sizes: tuple[int, ...]) -> list:
    """The inverse of `concat_shards` on outputs: y [..., sum(sizes)] shard-major -> [..., sizes[i]].
    Under tensor parallelism each device splits only its own block (no communication)."""
    lead = y.shape[:-1]
    blocks = y.reshape(*lead, shards, -1)  # [..., shards, sum(sizes) / shards]
    cuts = [sum(sizes[: i + 1]) // shards for i in range(len(sizes) - 1)]
    return [b.reshape(*lead, n) for b, n in zip(jnp.split(blocks, cuts, axis=-1), sizes)]


ROW_GROUP = 8  # XLA:CPU sums rows of a reduction this many at a time once there are that many


def mean_square(xf):
    """xf [..., H] float32 -> [..., 1]: the mean of xf * xf over H. On a CPU a row's result has the
    same bits whatever other rows share the call: XLA:CPU adds a row's H terms in one order when
    fewer than ROW_GROUP rows share a reduction and in another (vectorised across rows) from
    ROW_GROUP on, so the rows are padded to a multiple of ROW_GROUP and always take the second.
    A verification pass of 8 or more tree rows then normalises each token as the one-row decoding
    step does, which quantized targets need to stay lossless: their activations are rounded to
    integers after the norm, where a last-bit difference can flip a near tie."""
    if compile_target.platform() != "cpu":
        return jnp.mean(xf * xf, axis=-1, keepdims=True)
    lead, h = xf.shape[:-1], xf.shape[-1]
    r = math.prod(lead)
    flat = xf.reshape(r, h)
    if r % ROW_GROUP:
        flat = jnp.pad(flat, ((0, -r % ROW_GROUP), (0, 0)))
    return (jnp.sum(flat * flat, axis=-1)[:r] / h).reshape(*lead, 1)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(mean_square(xf) + self.eps)
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
        # Qwen3: weights [D], shared by every head (replicated under tensor parallelism; never out-major)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.cfg = cfg
        self.shards = 0  # 0: separate q/k/v_proj; n: one qkv_proj laid out for n shards

    def fuse(self, shards: int) -> None:
        """q/k/v_proj -> qkv_proj, kernel [Hin, (Nh + 2 Nkv) D] shard-major for `shards` shards."""
        if self.cfg.num_heads % shards or self.cfg.num_kv_heads % shards:
            raise JaxspecError(f"{shards} shards must divide the query and KV head counts")
        if not Linear.joinable([self.q_proj, self.k_proj, self.v_proj]):
            return  # GGUF blocks of different types: three products
        self.qkv_proj = Linear.concat([self.q_proj, self.k_proj, self.v_proj], shards)
        del self.q_proj, self.k_proj, self.v_proj
        self.shards = shards

    def heads(self, qkv):
        """The fused projection's output [B, T, (Nh + 2 Nkv) D] -> q [B, T, Nh, D], k and v [B, T, Nkv, D]."""
        cfg, (b, t, _) = self.cfg, qkv.shape
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = split_shards(qkv, self.shards, (nh * d, nkv * d, nkv * d))
        return q.reshape(b, t, nh, d), k.reshape(b, t, nkv, d), v.reshape(b, t, nkv, d)

    def project(self, x, norm: RMSNorm | None = None):
        """x: [B, T, Hin] (normed by `norm` first, if given) -> q [B, T, Nh, D], k and v [B, T, Nkv, D]
        (before RoPE; q and k per-head normed where the model has q_norm / k_norm)."""
        cfg, (b, t, _) = self.cfg, x.shape
        if self.shards:
            q, k, v = self.heads(self.qkv_proj(x, norm))
        else:
            x = x if norm is None else norm(x)
            nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.reshape(b, t, nh, d), k.reshape(b, t, nkv, d), v.reshape(b, t, nkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, q, k, v, positions, inv_freq, cache: KVCache, layer: int, local_mask, offset, backend):
        """RoPE, the KV write and attention for projected q, k, v -> (o [B, T, Nh * D], cache)."""
        cfg, (b, t) = self.cfg, q.shape[:2]
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        cache = cache.write(layer, k, v, cache.lengths + offset)
        k, v = cache.read(layer, whole=whole_buffers(backend, cache))
        o = attention(q, k, v, cache.lengths, local_mask, cfg.sliding_window, offset, backend, cache.sharding)
        return o.reshape(b, t, cfg.num_heads * cfg.head_dim), cache

    def __call__(self, x, positions, inv_freq, cache: KVCache, layer: int, local_mask, offset, backend, norm=None):
        q, k, v = self.project(x, norm)
        o, cache = self.attend(q, k, v, positions, inv_freq, cache, layer, local_mask, offset, backend)
        return self.o_proj(o), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.intermediate = i
        self.gate_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, bias=bias, dtype=dtype, rngs=rngs)
        self.shards = 0  # 0: separate gate/up_proj; n: one gate_up_proj laid out for n shards

    def fuse(self, shards: int) -> None:
        """gate/up_proj -> gate_up_proj, kernel [H, 2 I] shard-major for `shards` shards (1 when
        they do not divide I: the sharding rules then keep it whole on every device)."""
        shards = shards if self.intermediate % shards == 0 else 1
        if not Linear.joinable([self.gate_proj, self.up_proj]):
            return
        self.gate_up_proj = Linear.concat([self.gate_proj, self.up_proj], shards)
        del self.gate_proj, self.up_proj
        self.shards = shards

    def __call__(self, x, norm: RMSNorm | None = None):
        """x [..., H] (normed by `norm` first, if given) -> [..., H]."""
        if self.shards:
            g, u = split_shards(self.gate_up_proj(x, norm), self.shards, (self.intermediate, self.intermediate))
        else:
            x = x if norm is None else norm(x)
            g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(jax.nn.silu(g) * u)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, input_norm: bool = True, index: int | None = None):
        # EAGLE-1/2 draft layers have no input_layernorm.
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if input_norm else None
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # index: the layer's place in the target (None: a draft's layer), which says whether it is sparse
        sparse = index is not None and cfg.is_sparse(index)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(cfg, dtype, rngs) if sparse else MLP(cfg, dtype, rngs)

    def norms_in_products(self) -> bool:
        """Whether the two RMSNorms run inside the projections after them: GGUF blocks, where the
        native kernel normalises each row as it quantizes it (one call in place of the XLA ops of a
        norm; a row's result stays independent of the rows beside it)."""
        att, mlp = self.self_attn, self.mlp
        return (
            self.input_layernorm is not None
            and isinstance(mlp, MLP)
            and bool(att.shards and mlp.shards)
            and att.qkv_proj.gguf is not None
            and mlp.gate_up_proj.gguf is not None
        )

    def __call__(self, x, positions, inv_freq, cache, layer, local_mask, offset, backend):
        if fused_layer.applies(self, x.shape[0] * x.shape[1], backend, cache):  # few rows on a GPU: five kernels
            return fused_layer.run(self, x, positions, inv_freq, cache, layer, local_mask, offset, backend)
        if self.norms_in_products():
            a, cache = self.self_attn(
                x, positions, inv_freq, cache, layer, local_mask, offset, backend, self.input_layernorm
            )
            x = x + a
            return x + self.mlp(x, self.post_attention_layernorm), cache
        xn = x if self.input_layernorm is None else self.input_layernorm(x)
        a, cache = self.self_attn(xn, positions, inv_freq, cache, layer, local_mask, offset, backend)
        x = x + a
        h = self.post_attention_layernorm(x)
        # a MoE block reads the mesh (expert parallelism) from the KV cache's sharding, as attention does
        return x + (self.mlp(h, cache.sharding) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(h)), cache


class LlamaForCausalLM(nnx.Module):
    """Module paths mirror HF key names (`model.layers.3.self_attn.q_proj.weight` ->
    `layers[3].self_attn.q_proj.kernel`), see `jaxspec.models.params`; `fuse_projections` (for
    inference only) then replaces q/k/v_proj by qkv_proj and gate/up_proj by gate_up_proj."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype) * INIT_STD
        )
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, index=i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )
        self.out_major = False  # set by out_major: few-row logits from the tied embedding by small_rows_matmul
        self.head_int8: Linear | None = None  # w8a8_int8 (jaxspec/quant.py): an int8 copy of the LM head
        # --quantization gguf: the GGUF block type of embed_tokens, then [V, H / 32 * block bytes] uint8
        self.embed_kind: str | None = None

    @property
    def dtype(self):
        """The dtype activations and the KV cache run in (the parameters', float32 under GGUF blocks)."""
        return self.norm.weight[...].dtype

    def embed(self, tokens):
        """tokens [...] int32 -> their embeddings [..., H] in self.dtype."""
        if self.embed_kind is not None:
            return gguf.rows(self.embed_tokens[...], self.embed_kind, tokens).astype(self.dtype)
        return self.embed_tokens[...][tokens]

    def embedding_weight(self):
        """The whole embedding [V, H] as floats (read back from GGUF blocks where it is kept so)."""
        w = self.embed_tokens[...]
        if self.embed_kind is None:
            return w
        return gguf.rows(w, self.embed_kind, jnp.arange(self.cfg.vocab_size)).astype(self.dtype)

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
        x = self.embed(tokens)
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

    def head_weight(self):
        """The LM head [H, V] as floats (the tied embedding transposed; read back from GGUF blocks)."""
        if self.lm_head is None:
            return self.embedding_weight().T
        k = self.lm_head.kernel[...]
        if self.lm_head.gguf is not None:
            return gguf.rows(k, self.lm_head.gguf, jnp.arange(self.cfg.vocab_size)).astype(self.dtype).T
        return k.T if self.lm_head.out_major else k

    def logits(self, h):
        """h: [..., H] -> float32 logits [..., V]."""
        if self.head_int8 is not None:
            return self.head_int8(h).astype(jnp.float32)
        if self.lm_head is None:
            w = self.embed_tokens[...]
            if self.embed_kind is not None:
                return gguf.matmul(h.astype(jnp.float32), w, self.embed_kind)
            if self.out_major:
                return small_rows_matmul(h, w, jnp.float32)
            return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=jnp.float32)
        if self.lm_head.gguf is not None:
            return self.lm_head(h.astype(jnp.float32))
        return (h @ self.lm_head.kernel[...]).astype(jnp.float32)


def fuse_projections(model: nnx.Module, tp: int = 1) -> nnx.Module:
    """In place, for inference: every unfused Attention and MLP of `model` (a target, or a draft
    built from these layers) gets one qkv_proj / gate_up_proj laid out for `tp` shards; tp must
    divide the head counts (sharding.check_heads). Returns `model`."""
    for m in [m for _, m in nnx.iter_graph(model) if isinstance(m, (Attention, MLP)) and not m.shards]:
        m.fuse(tp)
    return model


def out_major(model: nnx.Module) -> nnx.Module:
    """In place, for inference on XLA:CPU with one device (after fuse_projections and quantization):
    every attention and MLP kernel of `model` (a target, or a draft built from these layers) is
    stored [out, in], and a tied LM head computes few-row logits the same way (small_rows_matmul).
    So is an EAGLE draft's feature projection (fc, [3 H or 2 H] -> H, run on every round's accepted
    tokens). Float LM head kernels of their own stay [in, out] (drafts read them directly). w8a8_int8
    kernels, the int8 LM head copy and a draft's int8 LM head included, go out-major for the native
    int8 kernel (jaxspec.native) when it is available, and otherwise stay [in, out], the layout
    XLA:CPU's int8 GEMM runs fastest. Returns `model`."""
    nodes = list(nnx.iter_graph(model))
    int8_too = any(isinstance(m, Linear) and m.act_int8 for _, m in nodes) and native.available()
    for path, m in nodes:
        lins = []
        if isinstance(m, Linear) and path and path[-1] == "lm_head" and m.act_int8:  # a draft's int8 LM head
            lins = [m]
        if isinstance(m, Linear) and path and path[-1] == "fc":  # an EAGLE draft's feature projection
            lins = [m]
        if isinstance(m, LlamaForCausalLM):
            m.out_major = True
            lins = [m.head_int8] if m.head_int8 is not None else []
        if isinstance(m, (Attention, MLP)):
            lins = [lin for _, lin in nnx.iter_graph(m) if isinstance(lin, Linear)]
        for lin in lins:
            if not lin.out_major and lin.gguf is None and (int8_too or not lin.act_int8):
                lin.kernel = nnx.Param(lin.kernel[...].T)
                lin.out_major = True
    return model

"""Sparse mixture-of-experts block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`) in Flax NNX.

Each row x [H] is routed: router probabilities softmax(x @ gate.weight.T) in float32 over E
experts, the top k of them (num_experts_per_tok) kept, renormalised to sum to 1 when
norm_topk_prob, and cast to x's dtype. The output is the weighted sum of those k experts' SwiGLU
MLPs, down(silu(x @ gate_e) * (x @ up_e)), each of moe_intermediate_size I. No shared expert.

The experts run as two grouped matmuls (`jax.lax.ragged_dot`) over the rows' T * k assignments
sorted by expert: every expert multiplies the contiguous run of rows routed to it, whatever the
number of rows of a call (a decoding step, a verification tree, a prefill chunk). XLA:CPU lowers
ragged_dot to a dense product masked per group (the work of every expert on every assignment), so
there up to GATHER_ROWS assignments (decoding steps, small trees) multiply the k selected experts'
weights gathered instead: 8x faster for one row of 8 experts out of 64 (H 1024, I 384), and the
gap grows with E. Elsewhere (GPUs) ragged_dot runs as a grouped GEMM.

Parameters (HF names: models/params.py, which stacks a checkpoint's per-expert tensors):
  gate.weight           [E, H]       the router, as HF stores it (float: never quantized)
  experts.gate_up_proj  [E, H, 2 I]  each expert's gate then up columns, in-major
  experts.down_proj     [E, I, H]
They stay as loaded: fuse_projections, quantization and out_major (models/llama.py, jaxspec/quant.py)
leave them alone (they are no `Linear`), tensor parallelism replicates them (no expert parallelism).

Shapes: T rows, H hidden, E experts, k experts per row, I expert intermediate size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import compile_target
from jaxspec.config import ModelConfig

INIT_STD = 0.02
GATHER_ROWS = 32  # on XLA:CPU, up to this many assignments (T * k) run experts_gathered


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (cfg.num_experts, cfg.hidden_size), dtype) * INIT_STD)


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nnx.Param(jax.random.normal(rngs.params(), (e, h, 2 * i), dtype) * INIT_STD)
        self.down_proj = nnx.Param(jax.random.normal(rngs.params(), (e, i, h), dtype) * INIT_STD)


def route(x, router_w, k: int, norm_topk_prob: bool):
    """x [T, H], router_w [E, H] -> (weights [T, k] in x's dtype, expert ids [T, k] int32), as HF:
    softmax in float32, top k (ties to the lower id), renormalised if norm_topk_prob."""
    logits = jnp.einsum("th,eh->te", x, router_w.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), ids.astype(jnp.int32)


def experts_ragged(x, weights, ids, gate_up, down):
    """x [T, H], weights / ids [T, k], gate_up [E, H, 2I], down [E, I, H] -> [T, H]: the T * k
    assignments sorted by expert, ragged_dot over each expert's run of rows, then unsorted and
    summed per row with their weights."""
    t, k = ids.shape
    e, i2 = gate_up.shape[0], gate_up.shape[-1]
    flat = ids.reshape(t * k)
    order = jnp.argsort(flat, stable=True)  # assignment slots grouped by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E] rows per expert, summing to T * k
    xs = x[order // k]  # [T * k, H]: row of each sorted assignment
    gu = jax.lax.ragged_dot(xs, gate_up.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    g, u = gu[:, : i2 // 2], gu[:, i2 // 2 :]
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    ys = jax.lax.ragged_dot(h, down.astype(x.dtype), sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, -1)  # back to [T, k, H]
    return jnp.sum(y * weights[..., None], axis=1)


def experts_gathered(x, weights, ids, gate_up, down):
    """experts_ragged's result with each assignment's expert weights gathered ([T * k, H, 2I] and
    [T * k, I, H]): the work and the weights read are the k selected experts', not all E."""
    t, k = ids.shape
    flat = ids.reshape(t * k)
    xs = jnp.repeat(x, k, axis=0)  # [T * k, H], assignment order
    gu = jnp.einsum("mh,mhj->mj", xs, gate_up[flat].astype(x.dtype), preferred_element_type=jnp.float32)
    g, u = jnp.split(gu, 2, axis=-1)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    ys = jnp.einsum("mi,mih->mh", h, down[flat].astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.sum(ys.astype(x.dtype).reshape(t, k, -1) * weights[..., None], axis=1)


class SparseMoeBlock(nnx.Module):
    """A Qwen3-MoE layer's feed-forward block: x [..., H] -> [..., H] (module docstring)."""

    is_moe = True  # (fused_layer: a layer with this block runs unfused)

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate = Router(cfg, dtype, rngs)
        self.experts = Experts(cfg, dtype, rngs)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def __call__(self, x):
        lead, hdim = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, hdim)
        weights, ids = route(rows, self.gate.weight[...], self.top_k, self.norm_topk_prob)
        few = rows.shape[0] * self.top_k <= GATHER_ROWS and compile_target.platform() == "cpu"
        run = experts_gathered if few else experts_ragged
        y = run(rows, weights, ids, self.experts.gate_up_proj[...], self.experts.down_proj[...])
        return y.reshape(*lead, hdim)

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
leave them alone (they are no `Linear`). Tensor parallelism alone (ep_size 1) replicates them.

Expert parallelism (ep_size > 1, jaxspec/sharding.py): the stacked weights are split on E over the
mesh's "ep" axis (and, with 1 < ep_size < tp_size, on I over "moe_tp", gate_up_proj then laid out
shard-major by `lay_out_experts`: [gate_0 | up_0 | gate_1 | up_1 ...] for moe_tp shards). The block
runs `experts_parallel`: routing on every device (rows and router replicated, as attention leaves
them), then a shard_map in which each device computes its own experts' share of every row (its
E / ep experts; assignments to other experts weigh 0) and one psum over the mesh adds the shares.
XLA emits that psum as an all-reduce of [T, H] per sparse layer, the same collective tensor
parallelism runs after o_proj / down_proj. The alternative, an all-to-all that sends each row only
to the devices holding its k experts and back, moves k / E of the rows instead of all of them, and
pays for it with a capacity per device (static shapes) and two exchanges; at decoding and
verification sizes (a few to a few hundred rows) the rows are small next to the expert weights each
step reads, so the all-reduce keeps one simple static-shaped program and drops nothing (not timed
against an all-to-all here). Large prefills are where an all-to-all would save bandwidth.

Shapes: T rows, H hidden, E experts, k experts per row, I expert intermediate size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec import compile_target
from jaxspec.config import ModelConfig
from jaxspec.sharding import EP_AXIS, MOE_TP_AXIS

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


def experts_parallel(mesh, x, weights, ids, gate_up, down, shards: int):
    """experts_ragged's result [T, H] with the experts split over `mesh` (module docstring): x [T, H],
    weights / ids [T, k] replicated; gate_up [E, H, 2I] and down [E, I, H] split on E over "ep" and,
    when shards > 1 (gate_up laid out shard-major for `shards` = moe_tp devices), on I over "moe_tp"."""
    ep = mesh.shape[EP_AXIS]
    inner = MOE_TP_AXIS if shards > 1 else None
    axes = (EP_AXIS, MOE_TP_AXIS) if inner else EP_AXIS  # shares to add (a group's devices share I)
    n = gate_up.shape[0] // ep  # experts per device
    few = ids.size <= GATHER_ROWS and compile_target.platform() == "cpu"

    def body(x, w, i, gu, dn):  # gu [n, H, 2I / shards], dn [n, I / shards, H]: this device's experts
        lo = jax.lax.axis_index(EP_AXIS) * n
        mine = (i >= lo) & (i < lo + n)
        w = jnp.where(mine, w, jnp.zeros_like(w))
        # others: id n (past every group: ragged_dot gives their rows 0), or n - 1 to gather
        i = jnp.where(mine, i - lo, n - 1 if few else n)
        y = (experts_gathered if few else experts_ragged)(x, w, i, gu, dn)
        return jax.lax.psum(y, axes)

    specs = (P(), P(), P(), P(EP_AXIS, None, inner), P(EP_AXIS, inner, None))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(
        x, weights, ids, gate_up, down
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _regroup(gate_up, a: int, b: int, sharding):
    """gate_up [E, H, a * b * c] with columns (a, b, c) -> columns (b, a, c), placed at `sharding`."""
    e, h, cols = gate_up.shape
    out = gate_up.reshape(e, h, a, b, cols // (a * b)).swapaxes(2, 3).reshape(e, h, cols)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


class SparseMoeBlock(nnx.Module):
    """A Qwen3-MoE layer's feed-forward block: x [..., H] -> [..., H] (module docstring)."""

    is_moe = True  # (fused_layer: a layer with this block runs unfused)

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate = Router(cfg, dtype, rngs)
        self.experts = Experts(cfg, dtype, rngs)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.shards = 1  # gate_up_proj's columns: [gate | up] (1), or shard-major for this many shards

    def lay_out(self, shards: int) -> None:
        """gate_up_proj shard-major for `shards` devices splitting I (nothing when they do not
        divide I: jaxspec/sharding.py then keeps I whole)."""
        i = self.experts.down_proj.shape[1]
        if shards <= 1 or i % shards or self.shards != 1:
            return
        gu = self.experts.gate_up_proj[...]
        sharding = getattr(gu, "sharding", None)
        sharding = sharding if isinstance(sharding, NamedSharding) else None
        self.experts.gate_up_proj = nnx.Param(_regroup(gu, 2, shards, sharding))
        self.shards = shards

    def __call__(self, x, sharding=None):
        """x [..., H] -> [..., H]. sharding: the target KV cache's (jaxspec/sharding.py), whose mesh
        says whether the experts are split (an "ep" axis) and how."""
        lead, hdim = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, hdim)
        weights, ids = route(rows, self.gate.weight[...], self.top_k, self.norm_topk_prob)
        gate_up, down = self.experts.gate_up_proj[...], self.experts.down_proj[...]
        mesh = None if sharding is None else sharding.mesh
        if mesh is not None and EP_AXIS in mesh.axis_names:
            return experts_parallel(mesh, rows, weights, ids, gate_up, down, self.shards).reshape(*lead, hdim)
        if self.shards > 1:  # laid out for expert parallelism, run without it: [gate | up] again
            gate_up = _regroup(gate_up, self.shards, 2, None)
        few = rows.shape[0] * self.top_k <= GATHER_ROWS and compile_target.platform() == "cpu"
        run = experts_gathered if few else experts_ragged
        y = run(rows, weights, ids, gate_up, down)
        return y.reshape(*lead, hdim)


def lay_out_experts(model: nnx.Module, shards: int) -> nnx.Module:
    """In place: every SparseMoeBlock of `model` laid out for `shards` devices per expert group
    (SparseMoeBlock.lay_out; shards 1: nothing). Returns `model`."""
    if shards > 1:
        for _, m in nnx.iter_graph(model):
            if isinstance(m, SparseMoeBlock):
                m.lay_out(shards)
    return model

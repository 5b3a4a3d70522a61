"""Tensor parallelism through JAX's SPMD partitioner: a 1-D ("tp",) device mesh and the
PartitionSpec of every target parameter and of the KV cache (Megatron layout); expert parallelism
for mixture-of-experts targets over the same devices (below).

Linear kernels are [in, out] (models/llama.py):
  q_proj, k_proj, v_proj, gate_proj, up_proj   column split  kernel P(None, "tp"), bias P("tp")
  qkv_proj, gate_up_proj (fused, shard-major)  column split  kernel P(None, "tp"), bias P("tp")
  o_proj, down_proj                            row split     kernel P("tp", None), bias replicated
  (quantized Linears' scale [out] is split like the bias)
  embed_tokens [V, H]                          vocab split   P("tp", None)
  lm_head kernel [H, V] (and w8a8's head_int8) vocab split   P(None, "tp")
  norms                                        replicated
  KV cache k, v: L x [B, S, Hkv, D]            KV-head split P(None, None, "tp")
Each device holds num_heads / tp query heads and the num_kv_heads / tp KV heads they read (GQA
groups stay whole). The engine runs fused projections (models/llama.py:fuse_projections) whose
columns are [q_0 | k_0 | v_0 | q_1 | ...] and [gate_0 | up_0 | gate_1 | ...] for tp shards, so the
same column split hands device s its q_s, k_s, v_s (gate_s, up_s). A split dimension that tp does
not divide (vocab, intermediate size) stays replicated. Drafts (EAGLE heads, STANDALONE models)
and their caches are replicated.
The target's weights go straight from the checkpoint to their shards (loader.load(mesh=...)).

Nothing else changes: params and caches are placed on the mesh, the same jitted programs run over
them, and XLA's partitioner inserts the collectives (all-reduce after o_proj / down_proj, vocab
gathers), so a speculative round stays one compiled program.

Expert parallelism (`ep_size`, SGLang's meaning): a mixture-of-experts target's experts are split
over the same tp_size devices, in ep_size groups of tp_size / ep_size devices (ep_size divides
tp_size; device d is in group d // (tp_size / ep_size), as SGLang's moe_ep_rank). The mesh's axis
names say which layout runs, so that everything that holds the mesh knows it:
  ("tp",)            ep_size 1       experts replicated (stacked weights P())
  ("ep",)            ep_size tp_size attention, MLP, vocabulary split over "ep" as over "tp" above;
                                     experts gate_up_proj [E, H, 2I] and down_proj [E, I, H] P("ep")
  ("ep", "moe_tp")   1 < ep < tp     the tensor-parallel splits over both axes (all tp devices, in
                                     the same order); experts P("ep", None, "moe_tp") and
                                     P("ep", "moe_tp", None): group g holds experts
                                     [g E / ep, (g + 1) E / ep), each of its devices a 1 / moe_tp
                                     slice of their intermediate columns (gate_up_proj laid out
                                     shard-major: models/moe.py)
One mesh over the same devices, rather than a second mesh axis with devices of its own, because
the expert weights are what a MoE model's memory is (all but a few percent of Qwen3-30B-A3B's):
splitting them over the devices tensor parallelism already uses is what lets a larger model fit,
and attention stays split as before, never repeated. models/moe.py runs the experts in a shard_map.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.args import check_ep_size
from jaxspec.config import ModelConfig
from jaxspec.errors import JaxspecError

AXIS = "tp"
EP_AXIS = "ep"  # experts' axis (and the tensor-parallel one when ep_size = tp_size)
MOE_TP_AXIS = "moe_tp"  # within an expert group (1 < ep_size < tp_size)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
ROW = ("o_proj", "down_proj")


def mesh_axes(tp_size: int, ep_size: int = 1) -> tuple[str, ...]:
    """The mesh's axis names for tp_size devices of which ep_size groups hold the experts (module
    docstring)."""
    if ep_size == 1:
        return (AXIS,)
    return (EP_AXIS,) if ep_size == tp_size else (EP_AXIS, MOE_TP_AXIS)


def make_mesh(tp_size: int, ep_size: int = 1) -> Mesh | None:
    """The mesh over the first tp_size devices, shaped (ep_size, tp_size / ep_size) for expert
    parallelism (module docstring); None for tp_size 1 (no mesh at all)."""
    n = len(jax.devices())
    if tp_size < 1 or tp_size > n:
        raise JaxspecError(
            f"tp_size must be in 1..{n} (the number of {jax.devices()[0].platform} devices), got {tp_size}"
        )
    check_ep_size(tp_size, ep_size)
    if tp_size == 1:
        return None
    names = mesh_axes(tp_size, ep_size)
    shape = (tp_size,) if len(names) == 1 else (ep_size, tp_size // ep_size)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:tp_size])


def tp_axis(mesh: Mesh) -> str | tuple[str, ...]:
    """The axis (or axes, all devices in order) that tensor parallelism splits over on `mesh`."""
    names = tuple(mesh.axis_names)
    return names[0] if len(names) == 1 else names


def ep_of(mesh: Mesh | None) -> int:
    """ep_size of `mesh` (1 without a mesh or without expert parallelism)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(EP_AXIS, 1))


def check_heads(cfg: ModelConfig, tp_size: int, ep_size: int = 1) -> None:
    """Each device must hold whole query heads and whole KV heads, and with ep_size > 1 each expert
    group whole experts of a mixture-of-experts model."""
    for name, heads in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads)):
        if heads % tp_size:
            raise JaxspecError(f"tp_size {tp_size} must divide the model's {name} ({heads})")
    if ep_size == 1:
        return
    if not cfg.sparse_layers:
        raise JaxspecError(
            f"ep_size {ep_size} needs a mixture-of-experts model (Qwen3-MoE); this {cfg.model_type} model has no experts"
        )
    if cfg.num_experts % ep_size:
        raise JaxspecError(f"ep_size {ep_size} must divide the model's num_experts ({cfg.num_experts})")


def param_spec(path: tuple, shape: tuple, tp: int, ep: int = 1) -> P:
    """PartitionSpec of the target parameter at NNX `path` (e.g. ("layers", 0, "mlp", "up_proj",
    "kernel")) on the mesh of `make_mesh(tp, ep)`."""
    name, parent = str(path[-1]), str(path[-2]) if len(path) > 1 else ""
    names = mesh_axes(tp, ep)
    axis = names[0] if len(names) == 1 else names
    spec: tuple[str | tuple[str, ...] | None, ...]
    if parent == "experts" and ep > 1:  # stacked experts gate_up_proj [E, H, 2I], down_proj [E, I, H]
        up = name == "gate_up_proj"
        inter = shape[2] // 2 if up else shape[1]  # I, split within a group when it divides evenly
        inner = MOE_TP_AXIS if MOE_TP_AXIS in names and inter % (tp // ep) == 0 else None
        return P(EP_AXIS, None, inner) if up else P(EP_AXIS, inner, None)
    if name == "embed_tokens":
        spec = (axis, None)
    elif (parent in ("lm_head", "head_int8") or parent in COLUMN) and name == "kernel":
        spec = (None, axis)
    elif parent in ("lm_head", "head_int8") or parent in COLUMN:  # bias or quantization scale [out]
        spec = (axis,)
    elif parent in ROW and name == "kernel":
        spec = (axis, None)
    else:
        return P()
    # gate_up_proj [H, 2I] is split only when tp divides I (else MLP.fuse lays it out for 1 shard)
    parts = 2 if parent == "gate_up_proj" else 1
    if any(a == axis and d % (tp * parts) for a, d in zip(spec, shape)):
        return P()
    return P(*spec)


def placer(mesh: Mesh | None):
    """place(path, array) -> the target parameter on `mesh` split by `param_spec` (None without a
    mesh). Loaders call it per tensor, so that no device ever holds the whole model."""
    if mesh is None:
        return None
    tp, ep = mesh.size, ep_of(mesh)
    return lambda path, x: put(x, NamedSharding(mesh, param_spec(path, x.shape, tp, ep)))


def shard_params(state: nnx.State, mesh: Mesh | None) -> nnx.State:
    """The target's parameter state placed on `mesh` (unchanged without a mesh; parameters that a
    loader already placed do not move)."""
    if mesh is None:
        return state
    place = placer(mesh)
    return nnx.from_flat_state([(p, v.replace(place(p, v[...]))) for p, v in nnx.to_flat_state(state)])


@dataclasses.dataclass(frozen=True)
class HostKeys:
    """PRNG keys as host data (a pytree leaf): key_data and the implementation's name."""

    data: np.ndarray
    impl: str


def _is_keys(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(tree):
    """tree's arrays as host values (numpy; PRNG keys as HostKeys): picklable, and the same on every
    process that computed them from the same inputs."""

    def one(x):
        return (
            HostKeys(np.asarray(jax.random.key_data(x)), str(jax.random.key_impl(x))) if _is_keys(x) else np.asarray(x)
        )

    return jax.tree_util.tree_map(one, tree)


@functools.lru_cache(maxsize=64)
def _moved_to(sharding):
    """A program that re-lays an array out at `sharding` (device_put does not, across processes)."""
    return jax.jit(lambda x: x, out_shardings=sharding)


def put(tree, sharding):
    """jax.device_put(tree, sharding), also when the sharding spans other processes' devices
    (several hosts): arrays of this process alone, and to_host's values, go as host values (the
    same on every process)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already over the mesh
            return x if x.sharding.is_equivalent_to(sharding, x.ndim) else _moved_to(sharding)(x)
        x = to_host(x) if isinstance(x, jax.Array) else x
        if isinstance(x, HostKeys):
            return jax.random.wrap_key_data(jax.device_put(x.data, sharding), impl=x.impl)
        return jax.device_put(np.asarray(x), sharding)

    return jax.tree_util.tree_map(one, tree)


def to_mesh(tree, mesh: Mesh | None):
    """to_host's values as arguments of programs whose inputs span several processes' devices
    (arrays of one process's devices do not match them): host arrays as they are (a program places
    them as it needs them), PRNG keys replicated over `mesh`."""
    rep = None if mesh is None else NamedSharding(mesh, P())
    one = lambda x: jax.random.wrap_key_data(put(x.data, rep), impl=x.impl) if isinstance(x, HostKeys) else x
    return jax.tree_util.tree_map(one, tree)


def replicate(tree, mesh: Mesh | None):
    """Every array of `tree` (draft params and caches, carried state) copied to every device of
    `mesh` (unchanged without a mesh). Inputs that a program returns and takes again start out
    replicated, as it returns them, so that the second call does not compile another program."""
    return tree if mesh is None else put(tree, NamedSharding(mesh, P()))


def kv_sharding(mesh: Mesh | None) -> NamedSharding | None:
    """Where KV buffers [B, S, Hkv, D] live: split on the KV-head axis (None without a mesh). No
    trailing None: how jit spells the caches it returns, so passing them back matches."""
    return None if mesh is None else NamedSharding(mesh, P(None, None, tp_axis(mesh)))


def init_distributed(addr: str | None, nnodes: int, node_rank: int) -> None:
    """Multi-host start-up (`--dist-init-addr HOST:PORT --nnodes N --node-rank R`, SGLang's flags):
    joins the N processes through jax.distributed; afterwards jax.devices() lists every host's
    devices and one mesh spans them. Must run before any other JAX call; nothing for nnodes 1."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise JaxspecError(f"need nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes={nnodes}, node_rank={node_rank}")
    if nnodes == 1:
        return
    if not addr:
        raise JaxspecError(
            "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, reachable from every host)"
        )
    jax.distributed.initialize(coordinator_address=addr, num_processes=nnodes, process_id=node_rank)

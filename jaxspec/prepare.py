"""Model preparation: how a loaded target and its draft become what the compiled programs run.

One pipeline for both, in this order:
  load      checkpoint -> Flax NNX model + config + tokenizer (jaxspec/loader.py; the draft's by
            its proposer, jaxspec/speculative/proposers/, which knows its checkpoint layout)
  fuse      q/k/v and gate/up projections joined into one matmul each (models/llama.py
            fuse_projections), columns shard-major for tensor parallelism
  quantize  int8 / fp8 / w8a8_int8 linear layers (jaxspec/quant.py), when asked
  lay out   on XLA:CPU with one device, out-major kernels (models/llama.py out_major): a few-row
            matmul runs as one pass over the weights
  shard     the target's parameters split over the tensor-parallel mesh (a MoE target's experts
            over its expert groups, their gate/up columns ordered for it first), the draft's
            replicated (jaxspec/sharding.py)

`prepare_target` and `prepare_draft` run it; `Engine` (jaxspec/engine.py) holds their results,
and the server reaches them through the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from flax import nnx

from jaxspec import compile_target
from jaxspec.args import EngineArgs
from jaxspec.config import SpecConfig
from jaxspec.convert.sources import open_hf_dir
from jaxspec.default_mode import shipped_draft_by_default
from jaxspec.drafts import bundled_draft_for
from jaxspec.loader import LoadedModel
from jaxspec.models.llama import fuse_projections, out_major
from jaxspec.models.moe import lay_out_experts
from jaxspec.models.mtp import mtp_layout
from jaxspec.quant import quantize_model
from jaxspec.sharding import replicate, shard_params
from jaxspec.speculative.proposers import Proposer, load_proposer

logger = logging.getLogger("jaxspec")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a model is prepared: fuse (the projections joined; shards: the tensor-parallel shard
    count its fused columns are ordered for), quantization (None: as loaded), cpu_out_major
    (out-major kernels for XLA:CPU), expert_shards (the devices of an expert group that split its
    experts' intermediate columns, which a MoE block's gate_up_proj is ordered for: models/moe.py)."""

    fuse: bool = True
    shards: int = 1
    quantization: str | None = None
    cpu_out_major: bool = False
    expert_shards: int = 1

    @classmethod
    def for_target(cls, args: EngineArgs, quantization: str | None, fuse: bool, out_major_ok: bool) -> Layout:
        """The target's layout; out-major kernels only on XLA:CPU with one device (and fused
        projections: the fused matmuls are the ones laid out)."""
        cpu = fuse and out_major_ok and args.tp_size == 1 and compile_target.platform() == "cpu"
        experts = args.tp_size // args.ep_size if args.ep_size > 1 else 1
        return cls(fuse, args.tp_size, quantization, cpu, experts)


def prepare(model: Any, layout: Layout) -> tuple[Any, Any]:
    """fuse -> quantize -> lay out one NNX model (changed in place: pass a clone to keep it).
    Returns (graphdef, params) as nnx.split gives them."""
    model = fuse_projections(model, layout.shards) if layout.fuse else model
    model = quantize_model(lay_out_experts(model, layout.expert_shards), layout.quantization)
    return nnx.split(out_major(model) if layout.cpu_out_major else model)


def prepare_target(loaded: LoadedModel, layout: Layout, mesh, given: bool) -> tuple[Any, Any]:
    """The target's (graphdef, params), its parameters placed on the tensor-parallel mesh (None: one
    device). given: the model is the caller's, so it is prepared as a copy and stays as it was."""
    model = loaded.model
    if given and (layout.fuse or layout.quantization or layout.expert_shards > 1):
        model = nnx.clone(model)
    graphdef, params = prepare(model, layout)
    if layout.quantization in ("int8", "fp8") and compile_target.platform() == "cpu":
        logger.warning(
            "%s weights on CPU: XLA:CPU converts them to float before each matmul, so decoding is slower "
            "than float32 here (they save memory; the speed is for GPUs; w8a8_int8 is the fast mode on CPU)",
            layout.quantization,
        )
    return graphdef, shard_params(params, mesh)


def prepare_draft(
    spec: SpecConfig, target: LoadedModel, dtype: str, layout: Layout, mesh, progress: bool
) -> tuple[Proposer, dict[str, Any]]:
    """The draft of `spec` (its proposer and parameters), prepared as `layout` says and replicated
    on the mesh. Drafts are small and replicated, so their projections are fused for one shard."""
    proposer, dparams = load_proposer(spec, target, dtype, progress)
    if "draft" in dparams and (layout.fuse or layout.quantization):  # model drafts (not NGRAM's corpus)
        draft = nnx.merge(proposer.graphdef, dparams["draft"])
        graphdef, dparams["draft"] = prepare(draft, dataclasses.replace(layout, shards=1, expert_shards=1))
        proposer = dataclasses.replace(proposer, graphdef=graphdef)
    return proposer, replicate(dparams, mesh)


def draft_from_target(loaded: LoadedModel, algo: str | None) -> tuple | None:
    """A draft the target itself supplies when no draft path is given: an MTP module inside its
    checkpoint (for EAGLE / NEXTN, as SGLang falls back to the target path), else a draft of that
    algorithm shipped with jaxspec for it (jaxspec.drafts); algo None (speculative_algorithm unset)
    asks for the target's default shipped draft where the target's mode wants one
    (jaxspec/default_mode.py: not under gguf, where it runs only when asked for by name)."""
    if algo is None and not shipped_draft_by_default(loaded.quantization):
        return None
    if algo == "EAGLE" and loaded.source_kind == "hf" and os.path.isdir(loaded.path):
        src = open_hf_dir(loaded.path, check_config=False)
        if mtp_layout(src.config, src.names):
            return ("EAGLE", loaded.path, None)
    return bundled_draft_for(loaded.path, loaded.cfg, algo)

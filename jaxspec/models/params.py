"""HF checkpoint key <-> NNX parameter path, and loading a model from named tensors.

The NNX module tree mirrors HF names, so the table is one rule:
  path ("layers", 3, "self_attn", "q_proj", "kernel") <-> "model.layers.3.self_attn.q_proj.weight" (transposed)
  ("embed_tokens",) <-> "model.embed_tokens.weight";  ("lm_head", "kernel") <-> "lm_head.weight" (transposed)
All missing / mismatched tensors are reported together. This is the unfused layout; engines fuse
q/k/v and gate/up only afterwards (models/llama.py:fuse_projections).

Mixture-of-experts layers (Qwen3-MoE, models/moe.py) hold each layer's experts stacked, under the
names HF transformers >= 5 gives them in memory: ("layers", 3, "mlp", "experts", "gate_up_proj")
[E, H, 2I] <-> "model.layers.3.mlp.experts.gate_up_proj" [E, 2I, H] (the last two axes swapped),
and down_proj [E, I, H] <-> [E, H, I]. Checkpoints store one tensor per expert
("model.layers.3.mlp.experts.7.gate_proj.weight"); `stack_experts` presents them under the stacked
names, so that the rest of loading sees one tensor per layer. The router is
("layers", 3, "mlp", "gate", "weight") <-> "model.layers.3.mlp.gate.weight" [E, H], as stored.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxspec import gguf
from jaxspec.config import ModelConfig
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import Linear, LlamaForCausalLM
from jaxspec.models.mtp import is_mtp_tensor

# Keys a checkpoint may carry that we do not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# a checkpoint's per-expert tensor: layer, expert, projection
PROJ = ("gate_proj", "up_proj", "down_proj")
EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_key(path: tuple) -> tuple[str, bool]:
    """NNX path -> (HF key, transpose? (of the last two axes))."""
    parts = [str(p) for p in path]
    transpose = parts[-1] == "kernel" or (len(parts) > 1 and parts[-2] == "experts")
    if parts == ["embed_tokens"]:
        return "model.embed_tokens.weight", False
    if parts[-1] in ("kernel",):
        parts[-1] = "weight"
    prefix = "" if parts[0] == "lm_head" else "model."
    return prefix + ".".join(parts), transpose


def stack_experts(
    cfg: ModelConfig, names: Iterable[str], get: Callable[[str], np.ndarray]
) -> tuple[list[str], Callable[[str], np.ndarray]]:
    """(names, get) with each MoE layer's per-expert tensors replaced by two stacked ones (module
    docstring): "model.layers.N.mlp.experts.gate_up_proj" [E, 2I, H] (expert e: its gate_proj rows,
    then its up_proj rows) and "...experts.down_proj" [E, H, I]. A checkpoint already stacked so
    passes through. A layer whose experts are not exactly 0..num_experts - 1, each with its three
    tensors, is a JaxspecError."""
    names = list(names)
    per_layer: dict[int, set[str]] = {}
    rest = []
    for n in names:
        m = EXPERT_KEY.match(n)
        if m:
            per_layer.setdefault(int(m[1]), set()).add(n)
        else:
            rest.append(n)
    if not per_layer:
        return names, get
    e = cfg.num_experts
    for layer, have in sorted(per_layer.items()):
        want = {f"model.layers.{layer}.mlp.experts.{i}.{p}.weight" for i in range(e) for p in PROJ}
        if have != want:
            bad = sorted(want - have)[:2] + sorted(have - want)[:2]
            raise JaxspecError(
                f"checkpoint does not match its config: layer {layer}'s experts are not {e} experts with "
                f"gate_proj / up_proj / down_proj each (e.g. {', '.join(bad)})"
            )
    stacked: dict[str, tuple[str, tuple[str, ...]]] = {}
    for layer in per_layer:
        p = f"model.layers.{layer}.mlp.experts."
        stacked[p + "gate_up_proj"] = (p, ("gate_proj", "up_proj"))
        stacked[p + "down_proj"] = (p, ("down_proj",))

    def get_stacked(key: str) -> np.ndarray:
        if key not in stacked:
            return get(key)
        p, projs = stacked[key]
        return np.stack([np.concatenate([np.asarray(get(f"{p}{i}.{q}.weight")) for q in projs]) for i in range(e)])

    return rest + list(stacked), get_stacked


def load_model(
    cfg: ModelConfig,
    names: Iterable[str],
    get: Callable[[str], np.ndarray],
    dtype=jnp.float32,
    progress: bool = True,
    desc: str = "loading weights",
    place=None,
) -> LlamaForCausalLM:
    """Builds the model from tensors `get(hf_key)` without materialising a random init.
    place(path, array) -> device array puts each tensor where it lives (None: the default device)."""
    # MTP modules a checkpoint may carry are drafts (models/mtp.py), not part of the target.
    ignore = lambda n: (
        n.endswith(IGNORED_SUFFIXES)
        or (n == "lm_head.weight" and cfg.tie_word_embeddings)
        or is_mtp_tensor(n, cfg.num_layers)
    )
    names, get = stack_experts(cfg, names, get)
    return load_module(
        lambda: LlamaForCausalLM(cfg, dtype, rngs=nnx.Rngs(0)), hf_key, names, get, dtype, progress, desc, ignore, place
    )


def load_gguf_blocks(cfg: ModelConfig, src, progress: bool = True, desc: str = "loading weights") -> LlamaForCausalLM:
    """The target of a GGUF Source (convert/gguf_llama.py) with its Q4_0 / Q4_1 / Q8_0 tensors kept
    as the file's blocks (jaxspec/gguf.py): each such Linear's kernel is uint8 [out, in / 32 * block
    bytes] with `gguf` set to its type, and a block-quantized token embedding stays so (embed_kind);
    with out a multiple of 8, in the kernel's interleaved layout (type + "x8", the same bytes).
    F32 / F16 tensors are read as float32. Nothing passes through a float32 copy of the blocks.
    Mixture-of-experts routers [E, H] and experts (stacked [E, H, 2I] and [E, I, H]; no Linear) are
    dequantized to float32 whatever their type (a warning says so). The caller checked the types
    (loader.check_gguf)."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    src_names, get = stack_experts(cfg, src.names, src.get)
    names, leaves, kinds, missing = set(src_names), [], {}, []
    if cfg.sparse_layers:
        logging.getLogger("jaxspec").warning(
            "gguf: the mixture-of-experts layers' routers and experts are read as float32 (only attention, "
            "dense MLP and embedding matrices keep their GGUF blocks)"
        )
    for path, var in tqdm(list(nnx.to_flat_state(state)), desc=desc, unit="tensor", disable=not progress, leave=False):
        key, transpose = hf_key(path)
        if key not in names:
            missing.append(key)
            continue
        kind = src.types.get(key)  # None: experts stacked from several GGUF tensors (read as float32)
        if kind in gguf.KINDS and (path[-1] == "kernel" or path == ("embed_tokens",)):
            kinds[path[:-1] if path[-1] == "kernel" else path] = kind
            rows, inner = (var.shape[1], var.shape[0]) if path[-1] == "kernel" else var.shape
            raw = src.blocks(key)
            if raw.shape != (rows, inner // gguf.BLOCK * gguf.block_bytes(kind)):
                raise JaxspecError(f"checkpoint does not match its config: {key} ({kind}) is not {rows} x {inner}")
            if rows % 8 == 0:  # the kernel's faster layout: 8 rows side by side (the same bytes)
                raw = gguf.interleave(raw, kind)
                kinds[path[:-1] if path[-1] == "kernel" else path] = kind + "x8"
            leaves.append((path, var.replace(jnp.asarray(np.array(raw)))))  # copies: see below
            continue
        arr = get(key)
        arr = np.swapaxes(arr, -1, -2) if transpose else arr
        if tuple(arr.shape) != tuple(var.shape):
            raise JaxspecError(
                f"checkpoint does not match its config: {key} is {tuple(arr.shape)}, not {tuple(var.shape)}"
            )
        # a copy: on CPU jax may keep a view of the GGUF file's memory map, and with it the whole map
        leaves.append((path, var.replace(jnp.asarray(np.array(arr, np.float32)))))
    if missing:
        raise JaxspecError(
            f"checkpoint does not match its config: {len(missing)} missing tensors (e.g. {', '.join(missing[:4])})"
        )
    model = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    for path, m in nnx.iter_graph(model):
        if tuple(path) in kinds and isinstance(m, Linear):
            m.gguf, m.out_major = kinds[tuple(path)], True
    model.embed_kind = kinds.get(("embed_tokens",))
    return model


def load_module(
    make,
    key_fn,
    names,
    get,
    dtype=jnp.float32,
    progress=True,
    desc="loading weights",
    ignore=lambda n: False,
    place=None,
):
    """Fills the module that `make()` builds with checkpoint tensors; key_fn(path) -> (key, transpose?).

    nnx.Param leaves are cast to `dtype`; other variables (e.g. int index tables) keep their dtype.
    Missing, mis-shaped and unexpected tensors are reported together as one JaxspecError."""
    names = set(names)
    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    missing, bad_shape, leaves = [], [], []
    used = set()
    for path, var in tqdm(list(flat), desc=desc, unit="tensor", disable=not progress, leave=False):
        key, transpose = key_fn(path)
        if key not in names:
            missing.append(key)
            continue
        used.add(key)
        arr = get(key)
        if transpose:
            arr = np.swapaxes(arr, -1, -2)
        if tuple(arr.shape) != tuple(var.shape):
            bad_shape.append(f"{key}: checkpoint {tuple(arr.shape)} vs model {tuple(var.shape)}")
            continue
        want = dtype if isinstance(var, nnx.Param) else var.dtype
        leaves.append(
            (
                path,
                var.replace(
                    jnp.asarray(arr, dtype=want) if place is None else place(path, np.asarray(arr, dtype=want))
                ),
            )
        )
    if missing or bad_shape:
        msg = []
        if missing:
            msg.append(f"{len(missing)} missing tensors (e.g. {', '.join(missing[:4])})")
        if bad_shape:
            msg.append(f"{len(bad_shape)} shape mismatches ({'; '.join(bad_shape[:4])})")
        raise JaxspecError("checkpoint does not match its config: " + "; ".join(msg))
    unexpected = [n for n in names - used if not ignore(n)]
    if unexpected:
        raise JaxspecError(
            f"checkpoint has {len(unexpected)} unexpected tensors (e.g. {', '.join(sorted(unexpected)[:4])})"
        )
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def module_tensors(module, key_fn) -> dict[str, np.ndarray]:
    """The inverse of `load_module`: checkpoint-named numpy tensors of every variable."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Variable)):
        key, transpose = key_fn(path)
        arr = np.asarray(var[...])
        out[key] = np.ascontiguousarray(np.swapaxes(arr, -1, -2) if transpose else arr)
    return out


def to_hf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The inverse of `load_model`: HF-named numpy tensors."""
    return module_tensors(model, hf_key)

"""HF checkpoint key <-> NNX parameter path, and loading a model from named tensors.

The NNX module tree mirrors HF names, so the table is one rule:
  path ("layers", 3, "self_attn", "q_proj", "kernel") <-> "model.layers.3.self_attn.q_proj.weight" (transposed)
  ("embed_tokens",) <-> "model.embed_tokens.weight";  ("lm_head", "kernel") <-> "lm_head.weight" (transposed)
All missing / mismatched tensors are reported together. This is the unfused layout; engines fuse
q/k/v and gate/up only afterwards (models/llama.py:fuse_projections).
"""

from __future__ import annotations

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


def hf_key(path: tuple) -> tuple[str, bool]:
    """NNX path -> (HF key, transpose?)."""
    parts = [str(p) for p in path]
    transpose = parts[-1] == "kernel"
    if parts == ["embed_tokens"]:
        return "model.embed_tokens.weight", False
    if parts[-1] in ("kernel",):
        parts[-1] = "weight"
    prefix = "" if parts[0] == "lm_head" else "model."
    return prefix + ".".join(parts), transpose


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
    return load_module(
        lambda: LlamaForCausalLM(cfg, dtype, rngs=nnx.Rngs(0)), hf_key, names, get, dtype, progress, desc, ignore, place
    )


def load_gguf_blocks(cfg: ModelConfig, src, progress: bool = True, desc: str = "loading weights") -> LlamaForCausalLM:
    """The target of a GGUF Source (convert/gguf_llama.py) with its Q4_0 / Q4_1 / Q8_0 tensors kept
    as the file's blocks (jaxspec/gguf.py): each such Linear's kernel is uint8 [out, in / 32 * block
    bytes] with `gguf` set to its type, and a block-quantized token embedding stays so (embed_kind);
    with out a multiple of 8, in the kernel's interleaved layout (type + "x8", the same bytes).
    F32 / F16 tensors are read as float32. Nothing passes through a float32 copy of the blocks.
    The caller checked the types (loader.check_gguf)."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    names, leaves, kinds, missing = set(src.names), [], {}, []
    for path, var in tqdm(list(nnx.to_flat_state(state)), desc=desc, unit="tensor", disable=not progress, leave=False):
        key, transpose = hf_key(path)
        if key not in names:
            missing.append(key)
            continue
        kind = src.types[key]
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
        arr = src.get(key)
        arr = arr.T if transpose else arr
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
            arr = arr.T
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
        out[key] = np.ascontiguousarray(arr.T if transpose else arr)
    return out


def to_hf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The inverse of `load_model`: HF-named numpy tensors."""
    return module_tensors(model, hf_key)

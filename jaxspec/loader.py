"""Load a model + tokenizer from a jaxspec checkpoint, an HF directory or a GGUF file."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxspec import gguf, native
from jaxspec.config import ModelConfig
from jaxspec.convert.source import hf_tokenizer
from jaxspec.convert.sources import checkpoint_quantization, open_source
from jaxspec.default_mode import gguf_default, may_keep_gguf_blocks
from jaxspec.default_model import default_gguf_path, default_model_path
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import LlamaForCausalLM
from jaxspec.models.params import load_gguf_blocks, load_model
from jaxspec.sharding import check_heads, ep_of, placer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def jnp_dtype(name) -> jnp.dtype:
    if name in (None, "auto"):
        return jnp.float32
    if name not in DTYPES:
        raise JaxspecError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    model: LlamaForCausalLM
    tokenizer: object
    path: str
    source_kind: str  # "hf" (also jaxspec checkpoints) | "gguf"
    # the checkpoint's own quantization (jaxspec.convert.sources.checkpoint_quantization: fp8, int8 or
    # w8a8_int8; its weights are read back dequantised), served unless --quantization says otherwise
    quantization: str | None = None


def resolve_model_path(model_path: str | None, progress: bool = True) -> str:
    if model_path in (None, "", "default"):
        return default_model_path(progress=progress)
    return model_path


def load(
    model_path: str | None,
    dtype: str = "float32",
    tokenizer_path: str | None = None,
    progress: bool = True,
    with_tokenizer: bool = True,
    mesh=None,
    quantization: str | None = None,
    keep_gguf: bool = False,
) -> LoadedModel:
    """mesh: a tensor-parallel mesh (jaxspec/sharding.py): each weight goes straight to its shards.
    quantization "gguf": a GGUF file's blocks kept as stored (jaxspec/gguf.py); other modes apply
    later (jaxspec/prepare.py). keep_gguf (`default_mode.may_keep_gguf_blocks`) with quantization
    None: a GGUF file whose tensors the kernel reads loads as "gguf" too (`default_mode.gguf_default`)."""
    keep_gguf = keep_gguf and quantization is None
    if (quantization == "gguf" or keep_gguf) and model_path in (None, "", "default"):
        path = default_gguf_path()  # the default model's GGUF file itself, not its float32 conversion
    else:
        path = resolve_model_path(model_path, progress)
    src = open_source(path)
    if keep_gguf:
        quantization = gguf_default(src)
    cfg = ModelConfig.from_hf(src.config)
    if mesh is not None:
        check_heads(cfg, mesh.size, ep_of(mesh))
    desc = f"loading {os.path.basename(path.rstrip('/'))}"
    if quantization == "gguf":
        check_gguf(src, dtype, mesh)
        model = load_gguf_blocks(cfg, src, progress, desc)
    else:
        model = load_model(cfg, src.names, src.get, jnp_dtype(dtype), progress, desc=desc, place=placer(mesh))
    quant = "gguf" if quantization == "gguf" else checkpoint_quantization(src.config) if src.kind == "hf" else None
    if not with_tokenizer:
        return LoadedModel(cfg, model, None, path, src.kind, quant)
    tokenizer = hf_tokenizer(tokenizer_path) if tokenizer_path else src.load_tokenizer()
    check_tokenizer(cfg, tokenizer, path)
    return LoadedModel(cfg, model, tokenizer, path, src.kind, quant)


def load_target(args, mesh=None, progress: bool = True, with_tokenizer: bool = True) -> LoadedModel:
    """The target of ModelArgs / EngineArgs `args`, in the quantization they ask for, else in the one
    jaxspec/default_mode.py decides (a GGUF on a CPU: its own blocks)."""
    keep, path, quant = may_keep_gguf_blocks(args), args.model_path, args.quantization
    return load(path, args.dtype, args.tokenizer_path, progress, with_tokenizer, mesh, quant, keep_gguf=keep)


def check_gguf(src, dtype, mesh) -> None:
    """What --quantization gguf needs, checked before any weight loads: a GGUF file whose tensors
    are all of the types the kernel multiplies (or float), float32, one CPU device, the kernel built."""
    if src.kind != "gguf":
        raise JaxspecError(
            f"--quantization gguf keeps a GGUF file's weight blocks as stored; {src.path} is not a GGUF file "
            "(use int8, fp8 or w8a8_int8 for other checkpoints)"
        )
    bad = gguf.unsupported_kinds(src.types)
    if bad:
        example = next(n for n, t in src.types.items() if t == bad[0])
        raise JaxspecError(
            f"{src.path} has GGUF tensors of type {', '.join(bad)} (e.g. {example}); --quantization gguf multiplies "
            f"{', '.join(gguf.KINDS)} blocks (and reads F32 / F16 as float32); serve this file without "
            "--quantization to read it as float32"
        )
    if dtype not in (None, "auto", "float32"):
        raise JaxspecError(f"--quantization gguf runs in float32 (activations, norms, KV cache), not --dtype {dtype}")
    if mesh is not None:
        raise JaxspecError("--quantization gguf runs on one CPU device; it does not split over --tp-size")
    if jax.default_backend() != "cpu":
        raise JaxspecError(
            f"--quantization gguf is CPU-only (its kernel is XLA:CPU code), and the backend is {jax.default_backend()}; "
            "serve the GGUF file without --quantization (read as float32) or with --quantization fp8 / int8"
        )
    why = native.gguf_unavailable()
    if why is not None:
        raise JaxspecError(f"--quantization gguf needs its native kernel, which is unavailable: {why}")


def check_tokenizer(cfg: ModelConfig, tokenizer, path: str) -> None:
    n = len(tokenizer)
    if n > cfg.vocab_size:
        raise JaxspecError(
            f"tokenizer mismatch for {path}: tokenizer has {n} tokens but the model's vocab_size is {cfg.vocab_size}"
        )

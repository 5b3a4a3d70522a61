"""Load a model + tokenizer from a jaxspec checkpoint, an HF directory or a GGUF file."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.convert.source import hf_tokenizer
from jaxspec.convert.sources import checkpoint_quantization, open_source
from jaxspec.default_model import default_model_path
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import LlamaForCausalLM
from jaxspec.models.params import load_model
from jaxspec.sharding import check_heads, placer

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
) -> LoadedModel:
    """mesh: a tensor-parallel mesh (jaxspec/sharding.py): each weight goes straight to its shards."""
    path = resolve_model_path(model_path, progress)
    src = open_source(path)
    cfg = ModelConfig.from_hf(src.config)
    if mesh is not None:
        check_heads(cfg, mesh.size)
    model = load_model(
        cfg,
        src.names,
        src.get,
        jnp_dtype(dtype),
        progress,
        desc=f"loading {os.path.basename(path.rstrip('/'))}",
        place=placer(mesh),
    )
    quant = checkpoint_quantization(src.config) if src.kind == "hf" else None
    if not with_tokenizer:
        return LoadedModel(cfg, model, None, path, src.kind, quant)
    tokenizer = hf_tokenizer(tokenizer_path) if tokenizer_path else src.load_tokenizer()
    check_tokenizer(cfg, tokenizer, path)
    return LoadedModel(cfg, model, tokenizer, path, src.kind, quant)


def check_tokenizer(cfg: ModelConfig, tokenizer, path: str) -> None:
    n = len(tokenizer)
    if n > cfg.vocab_size:
        raise JaxspecError(
            f"tokenizer mismatch for {path}: tokenizer has {n} tokens but the model's vocab_size is {cfg.vocab_size}"
        )

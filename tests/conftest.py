"""Shared fixtures: tiny random HF models (built with torch, the reference) and the default model."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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

    return jaxspec.Engine(show_progress=False)


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)

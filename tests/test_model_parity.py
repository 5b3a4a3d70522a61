"""Logit parity with HF transformers (torch, float32) on tiny random models of each family."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec.cache import KVCache

from helpers import FAMILIES


def load_dir(path, dtype="float32"):
    """Loads weights + config of an HF directory (tiny models have no tokenizer)."""
    from convert.sources import open_source
    from jaxspec.config import ModelConfig
    from jaxspec.loader import jnp_dtype
    from jaxspec.models.params import load_model

    src = open_source(path)
    return load_model(ModelConfig.from_hf(src.config), src.names, src.get, jnp_dtype(dtype), progress=False)


TOL = 1e-4


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def jax_logits(model, ids, chunk=None):
    """Full-sequence logits [B, T, V], optionally through chunked prefill of the KV cache."""
    ids = jnp.asarray(ids, jnp.int32)
    b, t = ids.shape
    chunk = chunk or t
    cache = KVCache.create(model.cfg, b, 64, jnp.float32)
    outs = []
    for s in range(0, t, chunk):
        tok = ids[:, s : s + chunk]
        pos = jnp.broadcast_to(jnp.arange(s, s + tok.shape[1]), tok.shape)
        h, cache, _ = model(tok, pos, cache)
        cache.lengths = cache.lengths + tok.shape[1]
        outs.append(model.logits(h))
    return np.asarray(jnp.concatenate(outs, axis=1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(hf_dirs, family):
    path, hf = hf_dirs[family]
    model = load_dir(path)
    ids = np.random.default_rng(1).integers(0, 97, size=(2, 12))
    ref = hf_logits(hf, ids)
    np.testing.assert_allclose(jax_logits(model, ids), ref, atol=TOL, rtol=0)
    # chunked prefill through the KV cache gives the same logits
    np.testing.assert_allclose(jax_logits(model, ids, chunk=5), ref, atol=TOL, rtol=0)


def test_llama3_rope_scaling_changes_logits(hf_dirs):
    """Guards the test above: the llama3 frequency scaling is actually exercised."""
    from jaxspec.config import ModelConfig, rope_inv_freq

    cfg = ModelConfig.from_hf(hf_dirs["llama31"][1].config.to_dict())
    plain = ModelConfig.from_hf(
        {**hf_dirs["llama31"][1].config.to_dict(), "rope_scaling": None, "rope_parameters": {"rope_theta": 500000.0}}
    )
    assert cfg.rope_type == "llama3"
    assert not np.allclose(rope_inv_freq(cfg), rope_inv_freq(plain))


def test_mistral_sliding_window_is_exercised(hf_dirs):
    """Without the window the logits differ, so the parity test above checks the window."""
    import dataclasses

    path, hf = hf_dirs["mistral"]
    model = load_dir(path)
    assert model.cfg.sliding_window == 6
    ids = np.random.default_rng(1).integers(0, 97, size=(1, 12))
    windowed = jax_logits(model, ids)
    model.cfg = dataclasses.replace(model.cfg, sliding_window=None)
    for layer in model.layers:
        layer.self_attn.cfg = model.cfg
    assert np.abs(jax_logits(model, ids) - windowed)[:, 6:].max() > 1e-3


def test_hidden_state_capture(hf_dirs):
    """Captured layer inputs equal HF's output_hidden_states (EAGLE-3 needs three of them)."""
    path, hf = hf_dirs["llama"]
    model = load_dir(path)
    ids = np.random.default_rng(2).integers(0, 97, size=(1, 7))
    with torch.no_grad():
        hs = hf(torch.tensor(ids), output_hidden_states=True).hidden_states  # hs[i] = input of layer i
    cache = KVCache.create(model.cfg, 1, 16, jnp.float32)
    _, _, cap = model(jnp.asarray(ids), jnp.arange(7)[None], cache, capture_layers=(0, 1))
    for j, layer in enumerate((0, 1)):
        np.testing.assert_allclose(np.asarray(cap[j]), hs[layer].numpy(), atol=TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_close_to_float32(hf_dirs, dtype):
    from jaxspec.loader import jnp_dtype

    path, hf = hf_dirs["llama"]
    model = load_dir(path, dtype)
    ids = np.random.default_rng(3).integers(0, 97, size=(1, 8))
    cache = KVCache.create(model.cfg, 1, 16, jnp_dtype(dtype))
    h, _, _ = model(jnp.asarray(ids), jnp.arange(8)[None], cache)
    assert h.dtype == jnp_dtype(dtype)
    got = np.asarray(model.logits(h))
    np.testing.assert_allclose(got, hf_logits(hf, ids), atol=0.05)

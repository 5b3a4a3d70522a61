"""Logit parity with HF transformers (torch, float32) on tiny random models of each family."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec.cache import KVCache

from helpers import FAMILIES, hf_logits, jax_logits


def load_dir(path, dtype="float32"):
    """Loads weights + config of an HF directory (tiny models have no tokenizer)."""
    from jaxspec.config import ModelConfig
    from jaxspec.convert.sources import open_source
    from jaxspec.loader import jnp_dtype
    from jaxspec.models.params import load_model

    src = open_source(path)
    return load_model(ModelConfig.from_hf(src.config), src.names, src.get, jnp_dtype(dtype), progress=False)


TOL = 1e-4


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


# ---- fused projections (what engines run) ---------------------------------------------------------


@pytest.mark.parametrize(
    "family,tp", [("llama", 1), ("llama", 2), ("llama_tied_bias", 1), ("qwen2", 2), ("mistral", 2)]
)
def test_fused_projections_give_unfused_logits(hf_dirs, family, tp):
    """One q/k/v and one gate/up matmul per layer, laid out for tp shards (here on one device), give
    the unfused logits: GQA (Nkv < Nh), with and without q/k/v bias."""
    from flax import nnx

    from jaxspec.models.llama import fuse_projections

    model = load_dir(hf_dirs[family][0])
    fused = fuse_projections(nnx.clone(model), tp)
    attn = fused.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and (attn.qkv_proj.bias is not None) == model.cfg.qkv_bias
    ids = np.random.default_rng(4).integers(0, 97, size=(2, 9))
    np.testing.assert_allclose(jax_logits(fused, ids, chunk=4), jax_logits(model, ids, chunk=4), atol=1e-5, rtol=0)


def test_fused_columns_are_shard_major(hf_dirs):
    """At tp = 2 the fused columns are [q_0 | k_0 | v_0 | q_1 | k_1 | v_1] (and [gate_0 | up_0 | gate_1 |
    up_1]), so a plain column split gives each device its own heads; the source model keeps its HF layout."""
    from flax import nnx

    from jaxspec.models.llama import fuse_projections
    from jaxspec.models.params import to_hf_tensors
    from jaxspec.sharding import param_spec

    model = load_dir(hf_dirs["qwen2"][0])  # q/k/v bias, 4 heads, 2 KV heads
    fused = fuse_projections(nnx.clone(model), 2)
    assert "model.layers.0.self_attn.q_proj.weight" in to_hf_tensors(model)

    def shard_major(*ws):
        return np.concatenate([np.split(np.asarray(w[...]), 2, -1)[s] for s in range(2) for w in ws], -1)

    for a, f in zip(model.layers, fused.layers):
        sa, sf, ma, mf = a.self_attn, f.self_attn, a.mlp, f.mlp
        for name in ("kernel", "bias"):
            want = shard_major(*(getattr(p, name) for p in (sa.q_proj, sa.k_proj, sa.v_proj)))
            np.testing.assert_array_equal(np.asarray(getattr(sf.qkv_proj, name)[...]), want)
        np.testing.assert_array_equal(
            np.asarray(mf.gate_up_proj.kernel[...]), shard_major(ma.gate_proj.kernel, ma.up_proj.kernel)
        )
    path = ("layers", 0, "mlp", "gate_up_proj", "kernel")
    assert param_spec(path, (64, 2 * 128), 2) == param_spec(path[:3] + ("up_proj", "kernel"), (64, 128), 2)
    assert param_spec(path, (64, 2 * 6), 4) == param_spec(path[:3] + ("up_proj", "kernel"), (64, 6), 4)


def test_engine_fuses_a_copy(hf_dirs):
    """Engine.from_model runs fused projections on a copy: the caller's model keeps q/k/v_proj and the
    greedy tokens equal an unfused engine's."""
    from jaxspec.engine import Engine

    model = load_dir(hf_dirs["llama_tied_bias"][0])
    sp = dict(temperature=0, max_new_tokens=8, ignore_eos=True)
    fused, plain = Engine.from_model(model, show_progress=False), Engine.from_model(model, _fuse=False)
    assert "qkv_proj" in fused.params["layers"][0]["self_attn"] and hasattr(model.layers[0].self_attn, "q_proj")
    assert "gate_up_proj" in fused.params["layers"][1]["mlp"]
    ids = [[5, 6, 7], [9, 10, 11, 12, 13]]
    assert [r["output_ids"] for r in fused.generate(input_ids=ids, sampling_params=sp)] == [
        r["output_ids"] for r in plain.generate(input_ids=ids, sampling_params=sp)
    ]


@pytest.mark.parametrize("family", ["llama_tied_bias", "qwen2", "mistral"])
@pytest.mark.parametrize("chunk", [1, 3, 12])  # one row (matrix-vector), a few (multiply-and-reduce), many (matmul)
def test_out_major_gives_in_major_logits(hf_dirs, family, chunk):
    """Out-major kernels (what CPU engines run) give the fused in-major logits whatever the row count:
    chunks of 1 and 3 tokens over 2 slots are 2 and 6 rows, 12 tokens 24 rows, and the tied LM head of
    llama_tied_bias takes the same three paths."""
    from flax import nnx

    from jaxspec.models.llama import SMALL_ROWS, fuse_projections, out_major

    fused = fuse_projections(load_dir(hf_dirs[family][0]))
    om = out_major(nnx.clone(fused))
    qkv = om.layers[0].self_attn.qkv_proj
    assert qkv.out_major and qkv.kernel.shape == fused.layers[0].self_attn.qkv_proj.kernel.shape[::-1]
    assert om.out_major and (om.lm_head is None or not om.lm_head.out_major)
    ids = np.random.default_rng(5).integers(0, 97, size=(2, 12))
    assert 2 * 12 <= SMALL_ROWS  # the 12-token chunk takes the multiply-and-reduce path too
    np.testing.assert_allclose(jax_logits(om, ids, chunk), jax_logits(fused, ids, chunk), atol=2e-5, rtol=0)


def test_small_rows_matmul_paths():
    """small_rows_matmul equals the matmul below, inside and above its row range, in float32 and bfloat16."""
    from jaxspec.models.llama import SMALL_ROWS, small_rows_matmul

    rng = np.random.default_rng(6)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    for rows in (1, 2, 5, SMALL_ROWS, SMALL_ROWS + 1):
        x = rng.standard_normal((rows, 1, 24)).astype(np.float32)
        got = small_rows_matmul(jnp.asarray(x), jnp.asarray(w))
        assert got.shape == (rows, 1, 40) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), x @ w.T, atol=1e-4, rtol=1e-5)
        xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
        got16 = small_rows_matmul(xb, wb, jnp.float32)
        ref16 = np.asarray(xb, np.float32) @ np.asarray(wb, np.float32).T
        assert got16.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got16), ref16, atol=2e-2, rtol=1e-2)

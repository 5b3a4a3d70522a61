"""Qwen3 dense models (`Qwen3ForCausalLM`): per-head RMSNorm on q and k before RoPE, head_dim given
apart from hidden / heads, no q/k/v bias, tied or untied embeddings. Tiny random models written by
HF transformers (torch, the reference) load through jaxspec's loader with HF's float32 logits,
decode HF's greedy tokens, decode the same tokens speculatively (the model as its own STANDALONE
draft, and NGRAM), and read back from a llama.cpp-named qwen3 GGUF file."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec import native
from jaxspec.cache import KVCache
from jaxspec.errors import JaxspecError

from helpers import GGUF_PARTS, hf_logits, jax_logits, load_float32, make_hf_model, path_engine, write_gguf

V = 256
TOL = 1e-4
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 3, 4]]
GREEDY = dict(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> (path, torch model): tied embeddings, default RoPE (and its F32 and Q8_0 GGUF files);
    untied embeddings, linear RoPE scaling."""
    d = tmp_path_factory.mktemp("qwen3")
    tied = make_hf_model("qwen3", 0, vocab_size=V, initializer_range=0.3)
    untied = make_hf_model("qwen3_untied_linear", 1, vocab_size=V, initializer_range=0.3)
    tied.save_pretrained(d / "tied")
    untied.save_pretrained(d / "untied")
    floats = dict.fromkeys(["token_embd", "output", *GGUF_PARTS.values()], "F32")
    return {
        "tied": (str(d / "tied"), tied),
        "untied": (str(d / "untied"), untied),
        "gguf": (write_gguf(tied, str(d / "tiny-qwen3.gguf"), floats), tied),
        "q8": (write_gguf(tied, str(d / "tiny-qwen3-q8.gguf"), {}), tied),
    }


def load_gguf(path):
    """The model of a GGUF file with its block-quantized tensors kept as blocks (--quantization gguf)."""
    from jaxspec.config import ModelConfig
    from jaxspec.convert.sources import open_source
    from jaxspec.models.params import load_gguf_blocks

    src = open_source(path)
    return load_gguf_blocks(ModelConfig.from_hf(src.config), src, progress=False)


def outputs(eng):
    return [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_config(dirs):
    from jax.sharding import PartitionSpec as P

    from jaxspec.config import ModelConfig
    from jaxspec.sharding import param_spec

    d = dirs["tied"][1].config.to_dict()
    cfg = ModelConfig.from_hf(d)
    assert (cfg.model_type, cfg.qk_norm, cfg.head_dim, cfg.qkv_bias, cfg.o_bias) == ("qwen3", True, 32, False, False)
    assert cfg.head_dim != cfg.hidden_size // cfg.num_heads and cfg.tie_word_embeddings
    assert ModelConfig.from_hf({**d, "attention_bias": True}).o_bias  # Qwen3's attention_bias: q/k/v and o
    untied = ModelConfig.from_hf(dirs["untied"][1].config.to_dict())
    assert (untied.rope_type, untied.rope_params, untied.tie_word_embeddings) == ("linear", (("factor", 2.0),), False)
    with pytest.raises(JaxspecError, match="sliding-window"):
        ModelConfig.from_hf({**d, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(JaxspecError, match="unsupported architecture"):
        ModelConfig.from_hf({**d, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]})
    # the norms [head_dim] are replicated under tensor parallelism (each device norms its own heads)
    assert param_spec(("layers", 0, "self_attn", "q_norm", "weight"), (32,), 2) == P()


@pytest.mark.parametrize("name", ["tied", "untied", "gguf"])
def test_logits_match_hf(dirs, name):
    """float32 logits within 1e-4 of HF's, in one pass and by chunks of the KV cache; from the HF
    directory and from the GGUF file (its q/k norms read from attn_q_norm / attn_k_norm)."""
    path, hf = dirs[name]
    loaded = load_float32(path)
    assert loaded.source_kind == ("gguf" if name == "gguf" else "hf") and loaded.cfg.head_dim == 32
    assert (loaded.model.lm_head is None) == (name != "untied")
    ids = np.random.default_rng(1).integers(0, V, size=(2, 12))
    ref = hf_logits(hf, ids)
    np.testing.assert_allclose(jax_logits(loaded.model, ids), ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(jax_logits(loaded.model, ids, chunk=5), ref, atol=TOL, rtol=0)


def test_qk_norms_are_exercised(dirs):
    """Guards the parity test: without the per-head norms the logits differ."""
    model = load_float32(dirs["tied"][0]).model
    ids = np.random.default_rng(2).integers(0, V, size=(1, 8))
    ref = jax_logits(model, ids)
    for layer in model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert np.abs(jax_logits(model, ids) - ref).max() > 1e-2


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_greedy_matches_hf_generate(dirs, name):
    """The engine (fused projections, out-major kernels on the CPU) decodes HF's greedy tokens; its
    q/k norm weights stay [head_dim] vectors beside the out-major kernels."""
    from transformers import GenerationConfig

    path, hf = dirs[name]
    eng = path_engine(path)
    attn = eng.params["layers"][0]["self_attn"]
    assert attn["q_norm"]["weight"][...].shape == (32,) and attn["k_norm"]["weight"][...].shape == (32,)
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist() for p in PROMPTS]
    assert [len(r) for r in ref] == [16, 16]
    assert outputs(eng) == ref


@pytest.mark.parametrize(
    "spec",
    [
        dict(
            speculative_algorithm="STANDALONE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
        ),
        dict(speculative_algorithm="NGRAM"),
    ],
    ids=["STANDALONE", "NGRAM"],
)
def test_speculation_is_token_identical_to_plain(dirs, spec):
    """The model as its own STANDALONE draft (on the CPU in w8a8_int8 by default: its q/k norms stay
    float), and NGRAM, decode plain greedy decoding's tokens, and drafts get accepted."""
    path = dirs["tied"][0]
    plain = outputs(path_engine(path))
    if spec["speculative_algorithm"] == "STANDALONE":
        spec = dict(spec, speculative_draft_model_path=path)
    eng = path_engine(path, **spec)
    if "draft" in eng.dparams:  # STANDALONE: int8 kernels (with the native kernel), float norms
        attn = eng.dparams["draft"]["layers"][0]["self_attn"]
        assert attn["k_norm"]["weight"][...].dtype == jnp.float32
        assert (attn["qkv_proj"]["kernel"][...].dtype == jnp.int8) == native.available()
    out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in out] == plain
    assert max(r["meta_info"]["spec_accept_length"] for r in out) > 1.0


def test_gguf_blocks_keep_the_norms_float(dirs):
    """A Q8_0 qwen3 file under --quantization gguf: matrices stay blocks, the q/k norms (F32) are
    read as float32, and the logits follow the float reading of the same file."""
    if jax.default_backend() != "cpu" or native.gguf_unavailable() is not None:
        pytest.skip("the GGUF kernel runs on XLA:CPU")
    path = dirs["q8"][0]
    blocks = load_gguf(path)
    attn = blocks.layers[0].self_attn
    assert attn.q_proj.gguf == "Q8_0x8" and attn.q_norm.weight[...].dtype == jnp.float32
    ids = np.random.default_rng(3).integers(0, V, size=(1, 8))
    ref = jax_logits(load_float32(path).model, ids)
    np.testing.assert_allclose(jax_logits(blocks, ids), ref, atol=0.05 * np.abs(ref).max(), rtol=0)


def test_fused_gpu_layer_is_not_taken(dirs):
    """The Pallas path's fused layer has no q/k norms: a Qwen3 layer stays unfused where the same
    layer without them would be fused, and the pallas backend (its kernels interpreted on the CPU)
    decodes the xla backend's tokens."""
    from flax import nnx

    from jaxspec.config import ModelConfig
    from jaxspec.models import fused_layer
    from jaxspec.models.llama import DecoderLayer, fuse_projections

    cfg = ModelConfig("qwen3", 97, 64, 128, 1, 4, 2, 16, 1e-5, 10000.0, qk_norm=True)
    cache = KVCache.create(cfg, 2, 32, jnp.float32)
    for qk_norm in (False, True):
        layer = fuse_projections(DecoderLayer(dataclasses.replace(cfg, qk_norm=qk_norm), jnp.float32, nnx.Rngs(0)))
        assert fused_layer.applies(layer, 8, "pallas", cache) == (not qk_norm)
    path = dirs["tied"][0]  # in-major kernels, as on a GPU (out-major ones are never fused)
    assert outputs(path_engine(path, attention_backend="pallas", _out_major=False)) == outputs(path_engine(path))

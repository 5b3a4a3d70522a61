"""Qwen3-MoE models (`Qwen3MoeForCausalLM`): Qwen3 attention, and in sparse layers a router over E
experts whose top k SwiGLU MLPs are summed with their (optionally renormalised) probabilities
(jaxspec/models/moe.py). Tiny random models written by HF transformers (torch, the reference) load
through jaxspec's loader (per-expert checkpoint tensors stacked) with HF's float32 logits, decode
HF's greedy tokens, and decode the same tokens speculatively (the model as its own STANDALONE
draft, and NGRAM); the block's grouped matmuls (ragged_dot over rows sorted by expert) equal a
dense computation of every expert on every row. The same weights written as llama.cpp's `qwen3moe`
GGUF files (router ffn_gate_inp, expert stacks ffn_{gate,up,down}_exps) read back to HF's logits,
decode HF's greedy tokens, keep their attention blocks under --quantization gguf (experts read as
float32), and files whose experts jaxspec cannot read are refused with a JaxspecError."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec.cache import KVCache
from jaxspec.errors import JaxspecError

from helpers import GGUF_PARTS, hf_logits, jax_logits, load_float32, make_hf_model, path_engine, write_gguf

V = 256
TOL = 1e-4
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 3, 4]]
GREEDY = dict(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> (path, torch model): "moe" (2 layers, layer 0 dense by mlp_only_layers, top-2
    renormalised, tied embeddings); "step2" (3 layers, layer 1 sparse by decoder_sparse_step 2,
    top-2 not renormalised, untied)."""
    d = tmp_path_factory.mktemp("qwen3_moe")
    out = {}
    for name, family, seed in (("moe", "qwen3_moe", 0), ("step2", "qwen3_moe_step2", 1)):
        hf = make_hf_model(family, seed, vocab_size=V, initializer_range=0.3)
        hf.save_pretrained(d / name)
        out[name] = (str(d / name), hf)
    return out


def outputs(eng):
    return [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def dense_reference(x, router_w, gate_up, down, k, norm_topk_prob):
    """Every expert on every row, weighted by a [T, E] matrix that is zero outside each row's top k:
    x [T, H], router_w [E, H], gate_up [E, H, 2I], down [E, I, H] -> [T, H]."""
    probs = jax.nn.softmax((x @ router_w.T).astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdims=True)
    w = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], ids].set(top)  # [T, E]
    gu = jnp.einsum("th,ehj->etj", x, gate_up)
    g, u = jnp.split(gu, 2, axis=-1)
    y = jnp.einsum("eti,eih->eth", jax.nn.silu(g) * u, down)  # [E, T, H]
    return jnp.einsum("te,eth->th", w, y)


def test_config(dirs):
    from jax.sharding import PartitionSpec as P

    from jaxspec.config import ModelConfig
    from jaxspec.sharding import param_spec

    d = dirs["moe"][1].config.to_dict()
    cfg = ModelConfig.from_hf(d)
    assert (cfg.model_type, cfg.qk_norm, cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok) == (
        "qwen3_moe",
        True,
        32,
        8,
        2,
    )
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.mlp_only_layers, cfg.sparse_layers) == (
        32,
        True,
        (0,),
        (1,),
    )
    step2 = ModelConfig.from_hf(dirs["step2"][1].config.to_dict())
    assert (step2.decoder_sparse_step, step2.norm_topk_prob, step2.sparse_layers) == (2, False, (1,))
    hash(cfg)  # a jit static argument
    # config.json of a released checkpoint spells it num_experts (transformers >= 5: num_local_experts)
    released = {k: v for k, v in d.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ModelConfig.from_hf(released) == cfg
    bad = {
        "shared expert": {**d, "shared_expert_intermediate_size": 64},
        "needs num_experts": {k: v for k, v in released.items() if k != "num_experts"},
        "more than num_experts": {**d, "num_experts_per_tok": 9},
        "sliding-window": {**d, "use_sliding_window": True},
        "unsupported architecture": {**d, "architectures": ["Qwen3ForCausalLM"]},
    }
    for match, c in bad.items():
        with pytest.raises(JaxspecError, match=match):
            ModelConfig.from_hf(c)
    # tensor parallelism alone (ep_size 1) replicates the router and the stacked experts (tests/test_expert_parallel.py)
    assert param_spec(("layers", 1, "mlp", "experts", "gate_up_proj"), (8, 64, 64), 2) == P()
    assert param_spec(("layers", 1, "mlp", "gate", "weight"), (8, 64), 2) == P()


@pytest.mark.parametrize(("rows", "norm_topk_prob"), [(1, True), (5, False), (37, True), (37, False)])
def test_block_matches_dense_reference(rows, norm_topk_prob):
    """The block equals every expert computed on every row and masked, for a decoding row, a small
    tree and a prefill chunk; both of its paths do: rows sorted by expert with ragged_dot per
    expert's run, and (few rows on the CPU) the selected experts' weights gathered."""
    from flax import nnx

    from jaxspec.config import ModelConfig
    from jaxspec.models.moe import GATHER_ROWS, SparseMoeBlock, experts_gathered, experts_ragged, route

    cfg = ModelConfig("qwen3_moe", 97, 64, 128, 2, 4, 2, 32, 1e-6, 1e6, qk_norm=True, num_experts=8)
    cfg = dataclasses.replace(cfg, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm_topk_prob)
    block = SparseMoeBlock(cfg, jnp.float32, nnx.Rngs(rows))
    keys = jax.random.split(jax.random.key(rows), 4)
    block.gate.weight[...] = jax.random.normal(keys[0], block.gate.weight.shape)
    block.experts.gate_up_proj[...] = 0.2 * jax.random.normal(keys[1], block.experts.gate_up_proj.shape)
    block.experts.down_proj[...] = 0.2 * jax.random.normal(keys[2], block.experts.down_proj.shape)
    x = jax.random.normal(keys[3], (rows, 64))
    p = block.gate.weight[...], block.experts.gate_up_proj[...], block.experts.down_proj[...]
    ref = dense_reference(x, *p, 2, norm_topk_prob)
    np.testing.assert_allclose(np.asarray(block(x)), np.asarray(ref), atol=1e-5, rtol=1e-5)
    w, ids = route(x, p[0], 2, norm_topk_prob)
    for run in (experts_ragged, experts_gathered):
        np.testing.assert_allclose(np.asarray(run(x, w, ids, *p[1:])), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert (rows * 2 <= GATHER_ROWS) == (rows < 37)  # the block took each path
    # jitted, and with leading axes [B, T, H]
    y = nnx.jit(lambda m, v: m(v))(block, x.reshape(1, rows, 64))
    np.testing.assert_allclose(np.asarray(y[0]), np.asarray(ref), atol=1e-5, rtol=1e-5)
    # bfloat16 parameters and rows: close to the float32 result
    yb = block(x.astype(jnp.bfloat16)) if rows == 5 else None
    if yb is not None:
        assert yb.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(yb, np.float32), np.asarray(ref), atol=0.05 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("name", ["moe", "step2"])
def test_logits_match_hf(dirs, name):
    """float32 logits within 1e-4 of HF's, in one pass and by chunks of the KV cache; the sparse
    layers are the config's, with their checkpoint's per-expert tensors stacked."""
    from jaxspec.models.llama import MLP
    from jaxspec.models.moe import SparseMoeBlock

    path, hf = dirs[name]
    model = load_float32(path).model
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    assert sparse == ([False, True] if name == "moe" else [False, True, False])
    assert all(isinstance(layer.mlp, MLP) for layer, s in zip(model.layers, sparse) if not s)
    assert model.layers[1].mlp.experts.gate_up_proj[...].shape == (8, 64, 64)
    ids = np.random.default_rng(1).integers(0, V, size=(2, 12))
    ref = hf_logits(hf, ids)
    np.testing.assert_allclose(jax_logits(model, ids), ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(jax_logits(model, ids, chunk=5), ref, atol=TOL, rtol=0)


def test_stacked_layout_and_checkpoint_errors(dirs):
    """HF's in-memory tensors (experts already stacked, transformers >= 5) load to the same model
    as the per-expert checkpoint, and `to_hf_tensors` gives them back; a checkpoint missing an
    expert's tensor is reported."""
    from flax import nnx

    from jaxspec.config import ModelConfig
    from jaxspec.models.params import load_model, to_hf_tensors

    path, hf = dirs["moe"]
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd  # [E, 2I, H]
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    stacked = load_model(cfg, sd.keys(), sd.__getitem__, progress=False)
    from_dir = load_float32(path).model
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(stacked)), nnx.to_flat_state(nnx.state(from_dir))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))
    back = to_hf_tensors(stacked)
    for k in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        np.testing.assert_array_equal(back[k], sd[k])

    from safetensors.numpy import load_file

    per_expert = load_file(f"{path}/model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in per_expert
    del per_expert["model.layers.1.mlp.experts.7.down_proj.weight"]
    with pytest.raises(JaxspecError, match=r"layer 1's experts are not 8 experts"):
        load_model(cfg, per_expert.keys(), per_expert.__getitem__, progress=False)


@pytest.fixture(scope="module")
def plain(dirs):
    """Plain greedy decoding's tokens of the "moe" model."""
    return outputs(path_engine(dirs["moe"][0]))


@pytest.mark.parametrize("name", ["moe", "step2"])
def test_greedy_matches_hf_generate(dirs, name):
    """The engine (fused projections, out-major dense kernels on the CPU; the experts as loaded)
    decodes HF's greedy tokens."""
    from transformers import GenerationConfig

    path, hf = dirs[name]
    eng = path_engine(path)
    mlp = eng.params["layers"][1]["mlp"]
    assert mlp["experts"]["gate_up_proj"][...].shape == (8, 64, 64)
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
def test_speculation_is_token_identical_to_plain(dirs, plain, spec):
    """The model as its own STANDALONE draft (on the CPU in w8a8_int8 by default: its router and
    experts stay float), and NGRAM, decode plain greedy decoding's tokens, and drafts get accepted."""
    path = dirs["moe"][0]
    if spec["speculative_algorithm"] == "STANDALONE":
        spec = dict(spec, speculative_draft_model_path=path)
    eng = path_engine(path, **spec)
    if "draft" in eng.dparams:
        mlp = eng.dparams["draft"]["layers"][1]["mlp"]
        assert mlp["experts"]["down_proj"][...].dtype == jnp.float32
        assert mlp["gate"]["weight"][...].dtype == jnp.float32
    out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in out] == plain
    assert max(r["meta_info"]["spec_accept_length"] for r in out) > 1.0


def test_quantized_target_keeps_experts_float(dirs):
    """--quantization int8 quantizes the attention and dense MLP kernels; the router and experts
    stay float, and decoding runs."""
    eng = path_engine(dirs["moe"][0], quantization="int8")
    layers = eng.params["layers"]
    assert layers[0]["mlp"]["down_proj"]["kernel"][...].dtype == jnp.int8
    assert layers[1]["mlp"]["experts"]["gate_up_proj"][...].dtype == jnp.float32
    assert [len(o) for o in outputs(eng)] == [16, 16]


def test_fused_gpu_layer_is_not_taken():
    """The Pallas path's fused layer has no mixture of experts: a sparse layer stays unfused even
    without q/k norms, where its dense twin would be fused."""
    from flax import nnx

    from jaxspec.config import ModelConfig
    from jaxspec.models import fused_layer
    from jaxspec.models.llama import DecoderLayer, fuse_projections

    cfg = ModelConfig("qwen3_moe", 97, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, num_experts=8, num_experts_per_tok=2)
    cfg = dataclasses.replace(cfg, moe_intermediate_size=32, mlp_only_layers=(0,))
    cache = KVCache.create(cfg, 2, 32, jnp.float32)
    for index in (0, 1):
        layer = fuse_projections(DecoderLayer(cfg, jnp.float32, nnx.Rngs(0), index=index))
        assert fused_layer.applies(layer, 8, "pallas", cache) == (index == 0)


# ---- llama.cpp's qwen3moe GGUF files ----------------------------------------------------------------

FLOATS = dict.fromkeys(
    ["token_embd", "output", *GGUF_PARTS.values(), "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"], "F32"
)


@pytest.fixture(scope="module")
def ggufs(dirs, tmp_path_factory):
    """name -> (path, torch model): "sparse" (every layer sparse, as llama.cpp's qwen3moe has them;
    its HF directory beside it) in F32 and with Q8_0 matrices and expert stacks; "moe" (the HF
    fixture: layer 0 dense, read back from its ffn_gate / ffn_up / ffn_down) in F32."""
    d = tmp_path_factory.mktemp("qwen3_moe_gguf")
    sparse = make_hf_model("qwen3_moe", 2, vocab_size=V, initializer_range=0.3, mlp_only_layers=[])
    sparse.save_pretrained(d / "sparse")
    moe = dirs["moe"][1]
    return {
        "sparse": (write_gguf(sparse, str(d / "sparse.gguf"), FLOATS), sparse),
        "sparse_dir": (str(d / "sparse"), sparse),
        "q8": (write_gguf(sparse, str(d / "sparse-q8.gguf"), {}), sparse),
        "moe": (write_gguf(moe, str(d / "moe.gguf"), FLOATS), moe),
    }


def test_gguf_config(ggufs):
    """The MoE fields read from the file's metadata and layers are the HF config's; top-k weights
    renormalised as llama.cpp does for qwen3moe; experts under the released per-expert names."""
    from jaxspec.config import ModelConfig
    from jaxspec.convert.sources import open_source

    for name, dense in (("sparse", ()), ("moe", (0,))):
        src = open_source(ggufs[name][0])
        cfg, ref = ModelConfig.from_hf(src.config), ModelConfig.from_hf(ggufs[name][1].config.to_dict())
        assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
            "qwen3_moe",
            8,
            2,
            32,
        )
        assert cfg.norm_topk_prob and cfg.mlp_only_layers == dense and cfg.sparse_layers == ref.sparse_layers
        assert (cfg.head_dim, cfg.num_kv_heads, cfg.qk_norm) == (ref.head_dim, ref.num_kv_heads, True)
        assert src.types["model.layers.1.mlp.experts.7.down_proj.weight"] == "F32"
        assert src.get("model.layers.1.mlp.experts.7.down_proj.weight").shape == (64, 32)  # [H, I]


@pytest.mark.parametrize("name", ["sparse", "moe"])
def test_gguf_logits_match_hf(ggufs, name):
    """float32 logits of the GGUF file within 1e-4 of those of the HF safetensors of the same
    weights (jaxspec's reading of them, and HF's), in one pass and by chunks of the KV cache."""
    path, hf = ggufs[name]
    loaded = load_float32(path)
    assert loaded.source_kind == "gguf" and loaded.cfg.model_type == "qwen3_moe"
    assert loaded.model.layers[1].mlp.experts.gate_up_proj[...].shape == (8, 64, 64)
    ids = np.random.default_rng(4).integers(0, V, size=(2, 12))
    ref = hf_logits(hf, ids)
    got = jax_logits(loaded.model, ids)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(jax_logits(loaded.model, ids, chunk=5), ref, atol=TOL, rtol=0)
    if name == "sparse":
        np.testing.assert_allclose(got, jax_logits(load_float32(ggufs["sparse_dir"][0]).model, ids), atol=TOL, rtol=0)


def test_gguf_greedy_matches_hf_generate(ggufs):
    """The engine over the F32 file (on the CPU: --quantization gguf by default, its experts read as
    float32) decodes HF's greedy tokens."""
    from transformers import GenerationConfig

    path, hf = ggufs["sparse"]
    eng = path_engine(path)
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist() for p in PROMPTS]
    assert outputs(eng) == ref


def test_gguf_blocks_keep_attention_and_read_experts_float(ggufs, caplog):
    """A Q8_0 qwen3moe file under --quantization gguf: attention matrices stay blocks, routers and
    experts are float32 (a warning says so), the logits follow the float reading of the same file,
    and the engine decodes with it."""
    from jaxspec import native

    if jax.default_backend() != "cpu" or native.gguf_unavailable() is not None:
        pytest.skip("the GGUF kernel runs on XLA:CPU")
    from jaxspec.config import ModelConfig
    from jaxspec.convert.sources import open_source
    from jaxspec.models.params import load_gguf_blocks

    path = ggufs["q8"][0]
    src = open_source(path)
    assert src.types["model.layers.0.mlp.experts.3.gate_proj.weight"] == "Q8_0"
    with caplog.at_level("WARNING", logger="jaxspec"):
        blocks = load_gguf_blocks(ModelConfig.from_hf(src.config), src, progress=False)
    assert "read as float32" in caplog.text
    layer = blocks.layers[0]
    assert layer.self_attn.q_proj.gguf == "Q8_0x8" and layer.self_attn.q_norm.weight[...].dtype == jnp.float32
    assert layer.mlp.experts.gate_up_proj[...].dtype == jnp.float32 and layer.mlp.gate.weight[...].shape == (8, 64)
    ids = np.random.default_rng(5).integers(0, V, size=(2, 12))
    float_model = load_float32(path).model
    ref = jax_logits(float_model, ids)
    # the kernel's int8 activations move the router's inputs a little, which flips a near tie of its
    # top k now and then (one position in 8 here): most positions, not all, stay within 5%
    close = np.abs(jax_logits(blocks, ids) - ref).max(-1) <= 0.05 * np.abs(ref).max()
    assert close.mean() >= 0.75, close
    # the experts of both readings are the same dequantized stacks
    np.testing.assert_array_equal(
        np.asarray(layer.mlp.experts.down_proj[...]), np.asarray(float_model.layers[0].mlp.experts.down_proj[...])
    )
    eng = path_engine(path, quantization="gguf")
    assert [len(o) for o in outputs(eng)] == [16, 16]


def test_gguf_unreadable_experts_are_refused(ggufs, tmp_path):
    """Expert stacks of a type the gguf package cannot dequantize (Q8_1), of a type the gguf mode's
    kernel does not multiply (Q5_0: read as float32 without --quantization gguf), or of a shape that
    disagrees with expert_count, are JaxspecErrors that say so."""
    from jaxspec.convert.sources import open_source
    from jaxspec.loader import load

    hf = ggufs["sparse"][1]
    q81 = write_gguf(hf, str(tmp_path / "q81.gguf"), {**FLOATS, "ffn_down_exps": "Q8_1"})
    with pytest.raises(JaxspecError, match=r"GGUF type Q8_1 cannot be read \(e\.g\. blk\.0\.ffn_down_exps"):
        open_source(q81)
    q50 = write_gguf(hf, str(tmp_path / "q50.gguf"), {**FLOATS, "ffn_up_exps": "Q5_0"})
    assert load_float32(q50).cfg.num_experts == 8  # read as float32
    with pytest.raises(JaxspecError, match="type Q5_0"):
        load(q50, "float32", progress=False, with_tokenizer=False, quantization="gguf")
    hf.config.num_experts = 4  # the metadata says 4 experts, the stacks hold 8
    try:
        bad = write_gguf(hf, str(tmp_path / "count.gguf"), FLOATS)
    finally:
        hf.config.num_experts = 8
    with pytest.raises(JaxspecError, match=r"ffn_\w+_exps\.weight has shape \[8, .*\[4 experts"):
        open_source(bad)

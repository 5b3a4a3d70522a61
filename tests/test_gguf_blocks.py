"""--quantization gguf: GGUF blocks kept as stored (jaxspec/gguf.py) and their native kernel
(jaxspec/native/gguf_matmul.cc), checked against references written from the block formats
(the `gguf` package's quantize / dequantize, llama.cpp's activation rounding restated in numpy),
on tiny GGUF files written with llama.cpp's public tensor names (tests/helpers.py write_gguf)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import gguf, native
from jaxspec.errors import JaxspecError

from helpers import GREEDY, PROMPTS, make_hf_model, quantize, save_eagle_head, write_gguf

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or native.gguf_unavailable() is not None, reason="the GGUF kernel runs on XLA:CPU"
)
KINDS = ("Q4_0", "Q4_1", "Q8_0")


def dequantize_ref(blocks: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(blocks, getattr(GGMLQuantizationType, kind))


def activations_ref(x: np.ndarray) -> np.ndarray:
    """x [R, I] as llama.cpp's Q8 activations read back: per block of 32 a float16 scale max|x| / 127
    and codes round(x * 127 / max|x|)."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = (amax / 127).astype(np.float16).astype(np.float32)
    q = np.round(xb * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0))
    return (q * d).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_matches_the_format(kind):
    w = np.random.default_rng(0).normal(size=(7, 96)).astype(np.float32)
    blocks = quantize(w, kind)
    assert blocks.shape == (7, 96 // 32 * gguf.block_bytes(kind))
    np.testing.assert_array_equal(np.asarray(gguf.dequantize(jnp.asarray(blocks), kind)), dequantize_ref(blocks, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_a_reference_and_rows_are_independent(kind):
    """The product of the dequantised weights and activations, for 1-13 rows (several passes of 8
    rows, both threads' shares of the weight rows); a row's result is bitwise the same alone."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(200, 576)).astype(np.float32)
    blocks = quantize(w, kind)
    wd = dequantize_ref(blocks, kind).reshape(w.shape)
    f = jax.jit(lambda x, b: native.gguf_matmul(x, b, kind))
    for rows in (1, 2, 3, 8, 9, 13):
        x = rng.normal(size=(rows, 576)).astype(np.float32) * rng.uniform(0.1, 10, size=(rows, 1)).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block
        y = np.asarray(f(x, blocks))
        ref = activations_ref(x) @ wd.T
        # Q4_1's offset term m * s rounds s = d_x sum q_x to float16, as llama.cpp does
        tol = 2e-3 if kind == "Q4_1" else 1e-5
        np.testing.assert_allclose(y, ref, rtol=0, atol=tol * np.abs(ref).max())
        assert np.array_equal(np.asarray(f(x[-1:], blocks))[0], y[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_interleaved_layout_holds_the_same_weights_and_products(kind):
    """The 8-row interleaved layout: the same bytes, rows read back exactly, products equal to the
    plain layout's up to float summation order, and rows independent of each other."""
    rng = np.random.default_rng(2)
    blocks = quantize(rng.normal(size=(64, 96)).astype(np.float32), kind)
    x8 = gguf.interleave(blocks, kind)
    assert x8.nbytes == blocks.nbytes and x8.shape[0] == 8
    ids = jnp.asarray([[0, 7, 8], [63, 20, 33]])
    np.testing.assert_array_equal(
        np.asarray(gguf.rows(jnp.asarray(x8), kind + "x8", ids)), dequantize_ref(blocks, kind).reshape(64, 96)[ids]
    )
    f = jax.jit(lambda x, w, k: native.gguf_matmul(x, w, k), static_argnums=2)
    for n in (1, 3, 9):
        x = rng.normal(size=(n, 96)).astype(np.float32)
        plain, inter = np.asarray(f(x, blocks, kind)), np.asarray(f(x, x8, kind + "x8"))
        np.testing.assert_allclose(inter, plain, rtol=0, atol=1e-5 * np.abs(plain).max())
        assert np.array_equal(np.asarray(f(x[-1:], x8, kind + "x8"))[0], inter[-1])


V = 96  # a vocabulary the hidden size's blocks cover (embedding rows are 64 wide: 2 blocks)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    hf = make_hf_model("llama", 3, vocab_size=V, num_hidden_layers=3, initializer_range=0.3, tie_word_embeddings=True)
    mixed = {"token_embd": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "ffn_down": "Q4_0"}
    untied = make_hf_model("llama", 4, vocab_size=V, num_hidden_layers=2, tie_word_embeddings=False)
    qwen2 = make_hf_model("qwen2", 5, vocab_size=V, num_hidden_layers=2)
    return {
        "hf": hf,
        "qwen2": write_gguf(qwen2, str(d / "tiny-qwen2.gguf"), {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0"}),
        "untied": write_gguf(untied, str(d / "tiny-untied.gguf"), {"output": "Q4_0", "ffn_gate": "Q4_1"}),
        "mixed": write_gguf(hf, str(d / "tiny-mixed.gguf"), mixed),
        "q4_1": write_gguf(
            hf,
            str(d / "tiny-q4_1.gguf"),
            {
                "token_embd": "Q8_0",
                **dict.fromkeys(
                    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_1"
                ),
            },
        ),
        "eagle": save_eagle_head(d / "eagle", "EAGLE", hf.config.to_dict(), seed=1, scale=10.0),
        "dir": str(d),
    }


def engine(path, **kw):
    from jaxspec.engine import Engine

    return Engine(path, skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=4, **kw)


def test_blocks_are_kept_and_decoding_follows_the_float_model(files):
    """Every matrix stays in the file's blocks (about the file's bytes, no float32 copy), q/k/v and
    gate/up still fuse when their types agree, and greedy decoding follows the same file read as
    float32 (activation rounding may part them late)."""
    q = engine(files["q4_1"], quantization="gguf", speculative_algorithm="NONE")
    leaves = jax.tree_util.tree_leaves(q.params)
    blocks = sum(x.nbytes for x in leaves if x.dtype == jnp.uint8)
    floats = sum(x.nbytes for x in leaves if x.dtype != jnp.uint8)
    tensors = os.path.getsize(files["q4_1"])
    assert blocks <= tensors and floats < 0.05 * tensors
    layer = q.params["layers"][0]
    assert layer["self_attn"]["qkv_proj"]["kernel"][...].dtype == jnp.uint8
    assert q.graphdef is not None and q.loaded.model.layers[0].mlp.down_proj.gguf == "Q4_1x8"
    assert layer["mlp"]["gate_up_proj"]["kernel"][...].dtype == jnp.uint8
    ref = engine(files["q4_1"], dtype="float32", speculative_algorithm="NONE")  # the same file read as float32
    a = [r["output_ids"] for r in q.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    b = [r["output_ids"] for r in ref.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert sum(x[:4] == y[:4] for x, y in zip(a, b)) >= 3


def test_mixed_types_and_speculation_lossless(files):
    """Q4_0, Q4_1 and Q8_0 in one file (q/k/v of one type fuse; gate Q8_0 and up Q8_0 fuse; down
    Q4_0 alone); EAGLE speculation with a float draft ("unquant") and with the default draft
    (w8a8_int8 beside a gguf target) decodes exactly what plain decoding of the gguf target does."""
    plain_engine = engine(files["mixed"], quantization="gguf", speculative_algorithm="NONE")
    assert plain_engine.params["layers"][0]["mlp"]["down_proj"]["kernel"][...].dtype == jnp.uint8
    plain = [r["output_ids"] for r in plain_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    for draft_mode in ("unquant", None):
        spec = engine(
            files["mixed"],
            quantization="gguf",
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=files["eagle"],
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=4,
            speculative_draft_model_quantization=draft_mode,
        )
        out = spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in out] == plain
        assert max(r["meta_info"]["spec_accept_length"] for r in out) > 1.0  # the draft was used
        int8 = [x.dtype for x in jax.tree_util.tree_leaves(spec.dparams["draft"])].count(jnp.dtype(jnp.int8))
        assert (int8 > 0) == (draft_mode is None and native.available())


def test_rmsnorm_rows_do_not_depend_on_the_other_rows():
    """A row's RMSNorm has the same bits alone and among 2-24 rows (XLA:CPU sums a reduction's rows
    in another order from 8 rows on unless they are padded: models/llama.py mean_square). A tree of
    8 or more nodes verified over a quantized target must normalise each token as decoding does."""
    from jaxspec.models.llama import RMSNorm

    norm = RMSNorm(576, 1e-5, jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 24, 576)), jnp.float32)
    f = jax.jit(lambda x: norm(x))
    alone = [np.asarray(f(x[:, r : r + 1]))[0, 0] for r in range(24)]
    for t in (2, 7, 8, 12, 24):
        got = np.asarray(f(x[:, :t]))[0]
        assert all(np.array_equal(got[r], alone[r]) for r in range(t)), t


def test_an_untied_head_in_blocks(files):
    """output.weight in blocks computes the logits (Q4_0, interleaved), its own type beside the others'."""
    q = engine(files["untied"], quantization="gguf", speculative_algorithm="NONE")
    assert q.loaded.model.lm_head.gguf == "Q4_0x8"
    ref = engine(files["untied"], dtype="float32", speculative_algorithm="NONE")
    one = dict(GREEDY, max_new_tokens=1)
    a = q.generate(input_ids=PROMPTS, sampling_params=one, return_logprob=True)
    b = ref.generate(input_ids=PROMPTS, sampling_params=one, return_logprob=True)
    assert sum(x["output_ids"] == y["output_ids"] for x, y in zip(a, b)) >= 3


def test_qwen2_with_biases(files):
    """A qwen2 file (q/k/v biases read as float32 beside Q4_0 blocks, rows as the file stores them)."""
    q = engine(files["qwen2"], quantization="gguf", speculative_algorithm="NONE")
    assert q.params["layers"][0]["self_attn"]["qkv_proj"]["bias"][...].dtype == jnp.float32
    ref = engine(files["qwen2"], dtype="float32", speculative_algorithm="NONE")
    one = dict(GREEDY, max_new_tokens=1)
    a = q.generate(input_ids=PROMPTS, sampling_params=one)
    b = ref.generate(input_ids=PROMPTS, sampling_params=one)
    assert sum(x["output_ids"] == y["output_ids"] for x, y in zip(a, b)) >= 3


def test_bad_input_is_a_clear_error(files, tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType  # noqa: F401  (the writer's types)

    hf = files["hf"]
    q5 = write_gguf(hf, str(tmp_path / "tiny-q5.gguf"), {"ffn_up": "Q5_0"})
    with pytest.raises(
        JaxspecError, match=r"type Q5_0 \(e.g\. model\.layers\.0\.mlp\.up_proj\.weight\).*Q4_0, Q4_1, Q8_0"
    ):
        engine(q5, quantization="gguf")
    # without the flag (the default): read as float32, the one reading that serves such a file
    assert engine(q5, speculative_algorithm="NONE").quantization is None
    with pytest.raises(JaxspecError, match="not a GGUF file"):
        from helpers import make_hf_model as _m

        _m("llama", 0).save_pretrained(tmp_path / "hf")
        engine(str(tmp_path / "hf"), quantization="gguf")
    with pytest.raises(JaxspecError, match="float32"):
        engine(files["q4_1"], quantization="gguf", dtype="bfloat16")
    data = open(files["q4_1"], "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(JaxspecError, match="corrupt or truncated GGUF"):
        engine(str(tmp_path / "cut.gguf"), quantization="gguf")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(JaxspecError, match="CPU-only"):
        engine(files["q4_1"], quantization="gguf")


def test_the_shipped_draft_runs_under_gguf_only_when_named():
    """Under gguf the shipped draft measured slower than plain decoding, so it is not turned on by
    itself; named, it is there as for any other mode."""
    import dataclasses

    from jaxspec.config import ModelConfig
    from jaxspec.convert.sources import open_source
    from jaxspec.default_model import default_gguf_path
    from jaxspec.loader import LoadedModel
    from jaxspec.prepare import draft_from_target

    path = default_gguf_path()
    loaded = LoadedModel(ModelConfig.from_hf(open_source(path).config), None, None, path, "gguf", "gguf")
    assert draft_from_target(loaded, None) is None
    assert draft_from_target(loaded, "EAGLE3") is not None
    assert draft_from_target(dataclasses.replace(loaded, quantization=None), None) is not None


def test_a_gguf_file_runs_at_its_own_quantization_by_default(files, tmp_path):
    """With neither --quantization nor --dtype a GGUF file on the CPU runs as gguf (jaxspec/default_mode.py),
    decoding exactly what --quantization gguf does; --dtype float32 reads it as float32, another
    --quantization is that one, and a float checkpoint keeps float32."""
    auto = engine(files["q4_1"], speculative_algorithm="NONE")
    assert auto.quantization == "gguf" and auto.loaded.model.layers[0].mlp.down_proj.gguf == "Q4_1x8"
    named = engine(files["q4_1"], quantization="gguf", speculative_algorithm="NONE")
    a = [r["output_ids"] for r in auto.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert a == [r["output_ids"] for r in named.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    f32 = engine(files["q4_1"], dtype="float32", speculative_algorithm="NONE")
    assert f32.quantization is None and f32.params["layers"][0]["mlp"]["down_proj"]["kernel"][...].dtype == jnp.float32
    assert engine(files["q4_1"], quantization="w8a8_int8", speculative_algorithm="NONE").quantization == "w8a8_int8"
    make_hf_model("llama", 0).save_pretrained(tmp_path / "hf")
    assert engine(str(tmp_path / "hf"), speculative_algorithm="NONE").quantization is None


@pytest.mark.parametrize("kind", ["Q4_1x8", "Q8_0"])
def test_a_norm_inside_the_kernel_is_the_norm_before_it(kind):
    """gguf_matmul with an RMSNorm's weight normalises each row first: close to the product of the
    rows normed in float64 (activation codes may round the other way at a tie), and a row's result
    bitwise the same alone or among others."""
    rng = np.random.default_rng(3)
    base = kind.removesuffix("x8")
    blocks = quantize(rng.normal(size=(64, 576)).astype(np.float32), base)
    w = gguf.interleave(blocks, base) if kind.endswith("x8") else blocks
    weight, eps = rng.uniform(0.5, 2.0, size=576).astype(np.float32), 1e-5
    f = jax.jit(lambda x, w, g: native.gguf_matmul(x, w, kind, (g, eps)))
    x = (rng.normal(size=(5, 576)) * rng.uniform(0.1, 30, size=(5, 1))).astype(np.float32)
    y = np.asarray(f(x, w, weight))
    x64 = x.astype(np.float64)
    normed = (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * weight).astype(np.float32)
    ref = np.asarray(native.gguf_matmul(normed, w, kind))
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-2 * np.abs(ref).max())
    for r in range(5):
        assert np.array_equal(np.asarray(f(x[r : r + 1], w, weight))[0], y[r])

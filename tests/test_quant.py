"""Weight quantization (jaxspec/quant.py): int8 / fp8 per-channel weights, quantized targets and
drafts, speculation lossless with respect to the quantized target, and the tensor-parallel layout
of the scales."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec.errors import JaxspecError
from jaxspec.quant import quantize_weight
from jaxspec.sharding import param_spec

from helpers import GREEDY, PROMPTS, engine, models  # noqa: F401  (models: fixture)


@pytest.mark.parametrize("mode,rel", [("int8", 0.5 / 127), ("fp8", 2.0**-4), ("w8a8_int8", 0.5 / 127)])
def test_quantize_weight_error_is_within_the_format_step(mode, rel):
    w = np.random.default_rng(0).normal(size=(64, 48)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero channel keeps scale 1 and dequantises to zeros
    q, scale = quantize_weight(w, mode)
    assert q.dtype == q_dtype(mode) and scale.shape == (48,)
    back = np.asarray(q, np.float32) * np.asarray(scale)
    amax = np.abs(w).max(0)
    # int8: half a step of amax/127; e4m3 (3 mantissa bits): at most 2^-4 of the value, or a subnormal step
    bound = amax * rel if mode != "fp8" else np.maximum(np.abs(w) * rel, amax / 448 * 2.0**-9)
    assert np.all(np.abs(back - w) <= bound + 1e-7)
    assert np.all(back[:, 3] == 0)
    assert np.abs(np.asarray(q, np.float32)).max() <= (448 if mode == "fp8" else 127)


def test_scales_split_like_the_bias_under_tensor_parallelism():
    assert param_spec(("layers", 0, "self_attn", "qkv_proj", "scale"), (96,), 2) == P("tp")
    assert param_spec(("layers", 0, "mlp", "down_proj", "scale"), (64,), 2) == P()
    assert param_spec(("layers", 0, "self_attn", "qkv_proj", "kernel"), (64, 96), 2) == P(None, "tp")
    assert param_spec(("lm_head", "kernel"), (64, 96), 2) == P(None, "tp")


@pytest.mark.parametrize(
    "mode", [pytest.param("int8", marks=pytest.mark.slow), "w8a8_int8", pytest.param("fp8", marks=pytest.mark.slow)]
)
def test_quantized_target_close_and_speculation_lossless(models, mode):  # noqa: F811
    ref = engine(models)
    q = engine(models, quantization=mode)
    qs = jnp.asarray([x.dtype for x in _leaves(q.params)].count(jnp.dtype(q_dtype(mode))))
    # 4 layers x (qkv, o, gate_up, down), and w8a8_int8's int8 copy of the LM head
    assert int(qs) == 4 * 4 + (mode == "w8a8_int8")
    # next-token distributions stay close to the float model's
    lp_ref = ref.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=1), return_logprob=True)
    lp_q = q.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=1), return_logprob=True)
    agree = [a["output_ids"] == b["output_ids"] for a, b in zip(lp_ref, lp_q)]
    assert sum(agree) >= 3
    # speculation verifies with the quantized target: token-identical to its own plain decoding,
    # with a float draft ("unquant") and with a draft quantized like the target
    plain = [r["output_ids"] for r in q.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    for draft_mode in ("unquant", None):
        spec = engine(
            models,
            "EAGLE",
            "eagle",
            (3, 2, 4),
            quantization=mode,
            speculative_draft_model_quantization=draft_mode,
        )
        out = [r["output_ids"] for r in spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        assert out == plain
        draft_q = [x.dtype for x in _leaves(spec.dparams["draft"])].count(jnp.dtype(q_dtype(mode)))
        assert (draft_q > 0) == (draft_mode is None)


def test_quantization_flag_errors(models):  # noqa: F811
    with pytest.raises(JaxspecError, match="int8, fp8, w8a8_int8"):
        engine(models, quantization="int4")
    with pytest.raises(JaxspecError, match="unquant"):
        engine(models, "EAGLE", "eagle", (3, 2, 4), speculative_draft_model_quantization="q4")


def q_dtype(mode):
    return jnp.float8_e4m3fn if mode == "fp8" else jnp.int8


def _leaves(state):
    import jax

    return jax.tree_util.tree_leaves(state)


def test_fp8_checkpoint_loads_and_is_served_in_fp8(models, tmp_path):  # noqa: F811
    """A checkpoint in the public fp8 layout (as llm-compressor / vLLM / SGLang read it, written here
    with torch): every linear `weight` as float8_e4m3fn [out, in] with a float32 `weight_scale`
    [out, 1], `quantization_config.quant_method` "fp8". It loads, runs in fp8, and decodes exactly
    as the float checkpoint quantized to fp8 by jaxspec."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = models["target"]
    out = tmp_path / "fp8"
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    tensors = load_file(f"{src}/model.safetensors")
    fp8 = {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
            fp8[name] = (w / scale).to(torch.float8_e4m3fn)
            fp8[name + "_scale"] = scale
        else:
            fp8[name] = w
    save_file(fp8, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(cfg))

    models_fp8 = dict(models, fp8=str(out))
    eng = engine(models_fp8, target="fp8")
    assert eng.quantization == "fp8"
    assert any(x.dtype == jnp.float8_e4m3fn for x in _leaves(eng.params))
    want = [
        r["output_ids"] for r in engine(models, quantization="fp8").generate(input_ids=PROMPTS, sampling_params=GREEDY)
    ]
    assert [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == want


def test_w8a8_matmul_matches_an_integer_reference_and_is_batch_invariant():
    """int8_matmul quantizes each row of x to int8 (scale max|x| / 127), multiplies in int32 and scales
    back: equal to a numpy reference of that scheme, close to the float product, and a row's output
    is bitwise the same alone (the one-row padding path) as inside a batch of any size."""
    from jaxspec.models.llama import int8_matmul

    rng = np.random.default_rng(1)
    w = rng.normal(size=(96, 40)).astype(np.float32)
    x = rng.normal(size=(2, 7, 96)).astype(np.float32)
    x[0, 2] = 0.0  # an all-zero row keeps scale 1 and gives zeros
    q, scale = quantize_weight(w, "w8a8_int8")
    y = np.asarray(int8_matmul(jnp.asarray(x), q, scale))
    assert y.shape == (2, 7, 40) and y.dtype == np.float32
    xs = np.abs(x).max(-1, keepdims=True) / 127
    xs = np.where(xs > 0, xs, 1.0).astype(np.float32)
    xq = np.clip(np.round(x / xs), -127, 127).astype(np.int64)
    ref = (xq @ np.asarray(q, np.int64)).astype(np.float32) * xs * np.asarray(scale)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    assert np.all(y[0, 2] == 0)
    assert np.abs(y - x @ w).max() < 0.05 * np.abs(x @ w).max()
    for rows in (1, 3, 14):
        part = np.asarray(int8_matmul(jnp.asarray(x.reshape(14, 96)[:rows]), q, scale))
        assert np.array_equal(part, y.reshape(14, 40)[:rows])


def test_w8a8_eagle3_draft_head_is_int8_and_lossless(models):  # noqa: F811
    """Under w8a8_int8 an EAGLE-3 draft's own LM head [H, Vd] is quantized like its layers (out-major
    for the native kernel on CPU); speculation stays token-identical to the target's plain decoding."""
    import jax

    from jaxspec import native

    plain = [
        r["output_ids"]
        for r in engine(models, quantization="w8a8_int8").generate(input_ids=PROMPTS, sampling_params=GREEDY)
    ]
    spec = engine(models, "EAGLE3", "eagle3", (3, 2, 6), quantization="w8a8_int8", speculative_adaptive=False)
    head = spec.dparams["draft"]["lm_head"]
    k = head["kernel"][...]
    out_major = jax.default_backend() == "cpu" and native.available()
    assert k.dtype == jnp.int8 and k.shape[1 if out_major else 0] == spec.cfg.hidden_size
    assert head["scale"][...].shape == (k.shape[0 if out_major else 1],)  # one scale per draft token
    assert [r["output_ids"] for r in spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == plain


def test_a_float_targets_draft_runs_in_int8_on_cpu(models):  # noqa: F811
    """On a CPU with the native int8 kernel, the draft of a float (or gguf) target runs in w8a8_int8
    unless told otherwise (`unquant`, another mode); online training and tensor parallelism keep it
    float. Elsewhere a draft follows its target. Speculation stays lossless either way."""
    from jaxspec import native
    from jaxspec.quant import draft_quantization

    int8 = "w8a8_int8" if native.available() else None
    assert draft_quantization(None, None) == int8 and draft_quantization("gguf", None) == int8
    assert draft_quantization(None, None, int8_on_cpu=False) is None
    assert draft_quantization(None, "unquant") == "unquant" and draft_quantization("int8", None) == "int8"
    assert draft_quantization("w8a8_int8", "unquant") == "unquant"
    spec = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_adaptive=False)
    assert spec._draft_layout.quantization == int8
    if int8 is not None:
        assert spec.dparams["draft"]["lm_head"]["kernel"][...].dtype == jnp.int8
    plain = [r["output_ids"] for r in engine(models).generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert [r["output_ids"] for r in spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == plain
    kept = engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_draft_model_quantization="unquant")
    assert kept._draft_layout.quantization == "unquant"
    assert kept.dparams["draft"]["lm_head"]["kernel"][...].dtype == jnp.float32


@pytest.mark.parametrize("native_kernel", [True, False])
def test_w8a8_kernel_layout(models, monkeypatch, native_kernel):  # noqa: F811
    """On CPU float kernels are stored out-major [out, in] (models/llama.py:out_major); w8a8_int8
    kernels too, the int8 LM head copy included, when the native int8 kernel is there (it reads
    out-major weights), and otherwise [in, out], the layout XLA:CPU's int8 GEMM runs fastest. Both
    decode alike (integer products are exact)."""
    import jax

    from jaxspec import native

    if native_kernel and not native.available():  # compiles and registers it (a CPU with a C++ compiler)
        pytest.skip("the native int8 kernel is not available here")
    monkeypatch.setattr(native, "available", lambda: native_kernel)

    def shapes(eng):
        return eng.params["layers"][0]["self_attn"]["qkv_proj"]["kernel"][...].shape, eng.params["head_int8"]["kernel"][
            ...
        ].shape

    f32_engine = engine(models)
    hidden, cpu = f32_engine.cfg.hidden_size, jax.default_backend() == "cpu"
    f32 = f32_engine.params["layers"][0]["self_attn"]["qkv_proj"]["kernel"][...].shape
    assert f32[1 if cpu else 0] == hidden
    eng = engine(models, quantization="w8a8_int8")
    qkv, head = shapes(eng)
    out_major = cpu and native_kernel
    assert qkv[1 if out_major else 0] == hidden and head[1 if out_major else 0] == hidden
    out = [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    monkeypatch.setattr(native, "available", lambda: not native_kernel)
    other = engine(models, quantization="w8a8_int8")
    assert shapes(other) != (qkv, head) or not cpu
    assert [r["output_ids"] for r in other.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == out


def _blockwise_fp8(w, bo: int, bi: int):
    """torch weight [out, in] -> (e4m3 weight, float32 weight_scale_inv [ceil(out/bo), ceil(in/bi)]),
    the block-wise layout of DeepSeek-V3 / Qwen3-FP8 checkpoints (one scale per bo x bi block)."""
    import torch

    rows, cols = w.shape
    nb_r, nb_c = -(-rows // bo), -(-cols // bi)
    scale = torch.zeros(nb_r, nb_c)
    for r in range(nb_r):
        for c in range(nb_c):
            blk = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi]
            scale[r, c] = max(blk.abs().max().item(), 1e-12) / 448.0
    full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def test_blockwise_fp8_checkpoint_loads(models, tmp_path):  # noqa: F811
    """A block-wise fp8 checkpoint (e4m3 `weight` + float32 `weight_scale_inv` per 48 x 32 block,
    partial blocks at the edges, quantization_config.weight_block_size) reads back to exactly
    q * scale_inv per block (a reference computed element by element here), is served in fp8, and
    decodes exactly as the same float weights quantized to fp8 by jaxspec. A scale of the wrong
    shape is a clear error."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from jaxspec.convert.sources import open_hf_dir

    src, bo, bi = models["target"], 48, 32
    tensors = load_file(f"{src}/model.safetensors")
    quant, deq = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            q, scale = _blockwise_fp8(w, bo, bi)
            quant[name], quant[name + "_scale_inv"] = q, scale
            qf = q.float().numpy()
            ref = np.empty_like(qf)
            for i in range(qf.shape[0]):
                for j in range(qf.shape[1]):
                    ref[i, j] = qf[i, j] * scale[i // bo, j // bi].item()
            deq[name] = ref
        else:
            quant[name] = w
    cfg = json.loads(open(f"{src}/config.json").read())

    def write(d, weights, config):
        shutil.copytree(src, d)
        save_file(weights, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config))
        return str(d)

    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bo, bi]}
    blockwise = write(tmp_path / "block", quant, {**cfg, "quantization_config": qcfg})
    read = open_hf_dir(blockwise)
    assert not any(n.endswith("_scale_inv") for n in read.names)
    for name, ref in deq.items():
        np.testing.assert_array_equal(read.get(name), ref)
    floats = {n: torch.from_numpy(deq[n]) if n in deq else w for n, w in tensors.items()}
    dequantized = write(tmp_path / "float", floats, cfg)

    eng = engine(dict(models, block=blockwise), target="block")
    assert eng.quantization == "fp8"
    want = engine(dict(models, deq=dequantized), target="deq", quantization="fp8")
    sp = dict(GREEDY, max_new_tokens=12)
    assert [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=sp)] == [
        r["output_ids"] for r in want.generate(input_ids=PROMPTS, sampling_params=sp)
    ]

    bad = write(tmp_path / "bad", quant, {**cfg, "quantization_config": {**qcfg, "weight_block_size": [16, 16]}})
    with pytest.raises(JaxspecError, match="weight_block_size"):
        open_hf_dir(bad).get(next(iter(deq)))


W8A8_CT = {  # llm-compressor's W8A8 int8 recipe, as its config.json describes it
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}
WEIGHT_ONLY_CT = {
    **W8A8_CT,
    "config_groups": {"group_0": {**W8A8_CT["config_groups"]["group_0"], "input_activations": None}},
}
INT8_FORMATS = [
    pytest.param("sglang-w8a8", {"quant_method": "w8a8_int8"}, "w8a8_int8", False, id="sglang-w8a8"),
    pytest.param("compressed-tensors-w8a8", W8A8_CT, "w8a8_int8", True, id="compressed-tensors-w8a8"),
    pytest.param(
        "compressed-tensors-weight-only",
        WEIGHT_ONLY_CT,
        "int8",
        True,
        id="compressed-tensors-weight-only",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("name,qcfg,mode,ct", INT8_FORMATS)
def test_int8_checkpoint_loads_with_its_own_weights(models, tmp_path, name, qcfg, mode, ct):  # noqa: F811
    """Checkpoints in the public int8 layouts, written here with torch from their tensor names: int8
    `weight` [out, in] with a per-output-channel `weight_scale` [out, 1] (absmax / 127; bfloat16 and
    with a zero `weight_zero_point` in the compressed-tensors ones). They load, are served in the mode
    their quantization_config names, with exactly the int8 weights jaxspec's own quantization of the
    same float weights gives, and decode as that model does."""
    import json
    import shutil

    import jax
    import torch
    from safetensors.torch import load_file, save_file

    src = models["target"]
    tensors = load_file(f"{src}/model.safetensors")
    quant = {}
    for n, w in tensors.items():
        if n.endswith("_proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True).float() / 127.0
            quant[n] = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
            quant[n + "_scale"] = scale.to(torch.bfloat16) if ct else scale
            if ct:
                quant[n + "_zero_point"] = torch.zeros_like(quant[n][:, :1])
                # the float model jaxspec quantizes: the same weights, read back at the stored scale's precision
                tensors[n] = quant[n].float() * quant[n + "_scale"].float()
        else:
            quant[n] = w
    out = tmp_path / name
    shutil.copytree(src, out)
    save_file(quant, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    floats = tmp_path / "float"
    shutil.copytree(src, floats)
    save_file(tensors, str(floats / "model.safetensors"))

    eng = engine(dict(models, q=str(out)), target="q")
    ref = engine(dict(models, f=str(floats)), target="f", quantization=mode)
    assert eng.quantization == mode
    ints = lambda e: [x for x in jax.tree_util.tree_leaves(e.params) if x.dtype == jnp.int8]
    assert len(ints(eng)) == len(ints(ref)) > 0
    for a, b in zip(ints(eng), ints(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = [r["output_ids"] for r in ref.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == want


def test_unsupported_quantized_checkpoints_are_clear_errors(models, tmp_path):  # noqa: F811
    """GPTQ / AWQ / 4-bit / group-wise configs are refused before the weights are read, naming the
    format; a scale whose shape is not per tensor or per channel is refused when read."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from jaxspec.convert.sources import checkpoint_quantization, open_hf_dir

    assert checkpoint_quantization({}) is None
    assert checkpoint_quantization({"quantization_config": {"quant_method": "FP8"}}) == "fp8"
    assert checkpoint_quantization({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}) == "fp8"
    for qc, match in [
        ({"quant_method": "gptq", "bits": 4}, "'gptq' \\(a 4-bit or calibrated format\\) is not supported"),
        ({"quant_method": "awq"}, "'awq'"),
        ({"quant_method": "mystery"}, "load the unquantized model and pass --quantization"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'modelopt' is not supported"),
        (
            {**W8A8_CT, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
            "4 bits, type int, strategy group are not supported",
        ),
        ({**W8A8_CT, "config_groups": {}}, "no config_groups"),
    ]:
        with pytest.raises(JaxspecError, match=match):
            checkpoint_quantization({"quantization_config": qc})
    src = models["target"]
    tensors = load_file(f"{src}/model.safetensors")
    n = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[n] = torch.ones_like(tensors[n], dtype=torch.int8)
    tensors[n + "_scale"] = torch.ones(tensors[n].shape[0], 2)  # group-wise: two scales per row
    out = tmp_path / "grouped"
    shutil.copytree(src, out)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "w8a8_int8"}}))
    with pytest.raises(JaxspecError, match="not group- or block-wise"):
        open_hf_dir(str(out)).get(n)

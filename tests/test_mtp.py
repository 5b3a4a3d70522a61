"""MTP modules as drafts (EAGLE / NEXTN path): DeepSeek-NextN and MiMo layouts on tiny random targets,
read from the target's own checkpoint or a separate one; lossless at temperature 0, target
distribution at temperature 1."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.models.mtp import build_mtp, mtp_config, mtp_key

from helpers import add_mtp_modules, chi2_pvalue, exact_pair_distribution, make_hf_model, mtp_tensors, sample_pairs

V = 16
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4], [4]]
GREEDY = dict(temperature=0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    out = {}
    for fam, kind in (("llama", "NEXTN"), ("qwen2", "NEXTN"), ("qwen2", "MIMO")):
        hf = make_hf_model(fam, 3, vocab_size=V, num_hidden_layers=3, initializer_range=0.3)
        base = d / f"{fam}-plain"
        if not base.exists():
            hf.save_pretrained(base)
        path = d / f"{fam}-{kind}"
        shutil.copytree(base, path)
        add_mtp_modules(path, kind, 1, seed=7)
        out[f"{fam}-{kind}"] = str(path)
        out[f"{fam}-plain"] = str(base)
        out[f"hf-{fam}"] = hf
    # a separate, draft-only NextN checkpoint (one layer, tensors at layer 0) for the llama target
    sep = d / "nextn-only"
    sep.mkdir()
    cfg = json.loads((d / "llama-plain" / "config.json").read_text())
    cfg.update(num_hidden_layers=1, num_nextn_predict_layers=1)
    (sep / "config.json").write_text(json.dumps(cfg))
    save_file(mtp_tensors("NEXTN", cfg, "model.layers.0.", seed=11), str(sep / "model.safetensors"))
    out["nextn-only"] = str(sep)
    return out


def gen(path, prompts=PROMPTS, sp=GREEDY, **kw):
    eng = Engine(path, skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=4, **kw)
    return eng, eng.generate(input_ids=prompts, sampling_params=sp)


@pytest.mark.parametrize("name", ["llama-NEXTN", "qwen2-NEXTN", "qwen2-MIMO"])
@pytest.mark.parametrize("knobs", [(3, 1, 4), pytest.param((3, 2, 6), marks=pytest.mark.slow)])
def test_mtp_from_the_target_checkpoint_is_lossless(models, name, knobs):
    fam = name.split("-")[0]
    _, plain = gen(models[f"{fam}-plain"])
    _, plain_mtp_ckpt = gen(models[name])  # the target loads from a checkpoint carrying MTP tensors
    assert [r["output_ids"] for r in plain_mtp_ckpt] == [r["output_ids"] for r in plain]
    eng, out = gen(
        models[name],
        speculative_algorithm="NEXTN",
        speculative_num_steps=knobs[0],
        speculative_eagle_topk=knobs[1],
        speculative_num_draft_tokens=knobs[2],
    )  # no draft path: the MTP module inside the target
    assert eng.speculative_algorithm == "EAGLE" and eng.spec.draft_model_path == models[name]
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in plain]
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in out)
    assert rounds < sum(len(r["output_ids"]) for r in out) - len(out)  # some drafts were accepted


def test_mtp_from_a_separate_checkpoint(models):
    _, plain = gen(models["llama-plain"])
    eng, out = gen(
        models["llama-plain"], speculative_algorithm="EAGLE", speculative_draft_model_path=models["nextn-only"]
    )
    # Llama-family auto defaults
    assert (eng.spec.num_steps, eng.spec.eagle_topk, eng.spec.num_draft_tokens) == (5, 4, 8)
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in plain]


def test_eagle_without_a_draft_or_mtp_module(models):
    with pytest.raises(JaxspecError, match="MTP module"):
        Engine(models["llama-plain"], skip_tokenizer_init=True, show_progress=False, speculative_algorithm="EAGLE")


@pytest.mark.slow
def test_mtp_sampling_matches_target_distribution(models):
    prompt, temp, n = [3, 1, 4], 1.0, 4096
    probs = exact_pair_distribution(models["hf-llama"], prompt, temp)
    eng = Engine(
        models["llama-NEXTN"],
        skip_tokenizer_init=True,
        show_progress=False,
        max_running_requests=512,
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
    )
    assert chi2_pvalue(sample_pairs(eng, prompt, n, temp), probs) > 1e-3


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("name,kind", [("llama-NEXTN", "NEXTN"), ("qwen2-MIMO", "MIMO")])
def test_mtp_forward_matches_the_layout_formula(models, name, kind):
    """One token with an empty cache (attention reduces to o_proj(v)), against numpy on the raw
    checkpoint tensors: checks concat order, which norms apply where, and MiMo's position-0 rule."""
    from safetensors.numpy import load_file

    from jaxspec.cache import KVCache

    cfg = json.loads(open(f"{models[name]}/config.json").read())
    prefix = f"model.layers.{cfg['num_hidden_layers']}." if kind == "NEXTN" else "model.mtp_layers.0."
    t = {k[len(prefix) :]: v for k, v in load_file(f"{models[name]}/model-mtp.safetensors").items()}
    mcfg = mtp_config(cfg)
    from jaxspec.models.params import load_module

    head = load_module(
        lambda: build_mtp(kind, mcfg, jnp.float32, nnx.Rngs(0)),
        mtp_key(""),
        [k for k in t if "shared_head.head" not in k and k != "embed_tokens.weight"],
        t.__getitem__,
        progress=False,
    )
    rng = np.random.default_rng(0)
    h, e = rng.normal(size=(2, 1, 1, mcfg.hidden_size)).astype(np.float32)
    eps, g = mcfg.rms_norm_eps, mcfg.num_heads // mcfg.num_kv_heads
    for pos in (0, 2):
        got, fed, _ = head(
            jnp.asarray(e), jnp.asarray(h), jnp.full((1, 1), pos, jnp.int32), KVCache.create(mcfg, 1, 4, jnp.float32)
        )
        if kind == "NEXTN":
            x = (
                np.concatenate([_rms(e, t["enorm.weight"], eps), _rms(h, t["hnorm.weight"], eps)], -1)
                @ t["eh_proj.weight"].T
            )
        else:
            ee = e * 0 if pos == 0 else e
            x = (
                np.concatenate(
                    [_rms(h, t["hidden_layernorm.weight"], eps), _rms(ee, t["token_layernorm.weight"], eps)], -1
                )
                @ t["input_proj.weight"].T
            )
        xn = _rms(x, t["input_layernorm.weight"], eps)
        v = xn @ t["self_attn.v_proj.weight"].T + t.get("self_attn.v_proj.bias", 0)
        v = np.repeat(v.reshape(1, 1, mcfg.num_kv_heads, mcfg.head_dim), g, axis=2).reshape(1, 1, -1)
        y = x + v @ t["self_attn.o_proj.weight"].T
        yn = _rms(y, t["post_attention_layernorm.weight"], eps)
        act = yn @ t["mlp.gate_proj.weight"].T
        y = y + ((act / (1 + np.exp(-act))) * (yn @ t["mlp.up_proj.weight"].T)) @ t["mlp.down_proj.weight"].T
        want = _rms(y, t["shared_head.norm.weight" if kind == "NEXTN" else "final_layernorm.weight"], eps)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(np.asarray(fed), want, rtol=2e-4, atol=2e-4)

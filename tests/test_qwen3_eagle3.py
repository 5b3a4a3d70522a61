"""EAGLE-3 over a Qwen3 target: a tiny random Qwen3 checkpoint (written by HF transformers) and a tiny
random EAGLE-3 head written by hand under the public tensor names of released EAGLE-3 heads
(`LlamaForCausalLMEagle3`, as SpecForge and the EAGLE authors save them: no "model." prefix, a draft
vocabulary mapped by `d2t` / `t2d`, and a config.json carrying `draft_vocab_size` and the head's own
`head_dim`, which, as for Qwen3 targets, differs from hidden_size / num_attention_heads). Nothing is
written by jaxspec's exporter, so a layout mistake the exporter and the loader share cannot pass.

Greedy speculation through the Engine emits plain greedy decoding's tokens, with drafts accepted;
sampled speculation at temperature 1 emits valid tokens (its statistics are tested elsewhere)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import make_hf_model, path_engine

V = 32  # target vocabulary: small, so that random drafts get accepted now and then
DRAFT_VOCAB = 24  # the head's own vocabulary, a subset of the target's (d2t)
LAYERS = 8  # EAGLE-3's default features: the inputs of target layers [2, N // 2, N - 3] = (2, 4, 5)
INTER = 96  # the head's own intermediate_size (the target's is 128)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 3, 4]]
GREEDY = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)


def public_eagle3_tensors(tcfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Random EAGLE-3 head tensors under the public names, shapes as a released head has them
    for a target of hidden size H, vocabulary V, attention heads n (KV heads m) of head_dim d:
    fc [H, 3H]; midlayer attention over [2H] inputs: q [n d, 2H], k / v [m d, 2H], o [H, n d];
    MLP gate / up [I, H], down [H, I]; norms [H]; lm_head [Vd, H]; d2t [Vd] int64; t2d [V] bool."""
    rng = np.random.default_rng(seed)
    h, v = tcfg["hidden_size"], tcfg["vocab_size"]
    n, m, d = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["head_dim"]
    mat = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
    norm = lambda: (1 + 0.2 * rng.standard_normal(h)).astype(np.float32)
    p = "midlayer."
    w = {
        "fc.weight": mat(h, 3 * h),
        p + "input_layernorm.weight": norm(),
        p + "hidden_norm.weight": norm(),
        p + "self_attn.q_proj.weight": mat(n * d, 2 * h),
        p + "self_attn.k_proj.weight": mat(m * d, 2 * h),
        p + "self_attn.v_proj.weight": mat(m * d, 2 * h),
        p + "self_attn.o_proj.weight": mat(h, n * d),
        p + "post_attention_layernorm.weight": norm(),
        p + "mlp.gate_proj.weight": mat(INTER, h),
        p + "mlp.up_proj.weight": mat(INTER, h),
        p + "mlp.down_proj.weight": mat(h, INTER),
        "norm.weight": norm(),
        "lm_head.weight": 3 * mat(DRAFT_VOCAB, h),
    }
    ids = np.sort(rng.choice(v, DRAFT_VOCAB, replace=False))  # the target ids the head can propose
    w["d2t"] = (ids - np.arange(DRAFT_VOCAB)).astype(np.int64)  # target id = draft id + d2t[draft id]
    w["t2d"] = np.isin(np.arange(v), ids)
    return w


def write_public_head(path, tcfg: dict, seed: int = 0) -> str:
    """A head directory as released: model.safetensors + a SpecForge-style config.json."""
    cfg = dict(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=tcfg["hidden_size"],
        intermediate_size=INTER,
        num_attention_heads=tcfg["num_attention_heads"],
        num_key_value_heads=tcfg["num_key_value_heads"],
        head_dim=tcfg["head_dim"],
        num_hidden_layers=1,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        max_position_embeddings=2048,
        vocab_size=tcfg["vocab_size"],
        draft_vocab_size=DRAFT_VOCAB,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    os.makedirs(path, exist_ok=True)
    save_file(public_eagle3_tensors(tcfg, seed), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(target directory, head directory): a tied-embedding Qwen3 of 8 layers, head_dim 32 (not
    hidden 64 / 4 heads), and its EAGLE-3 head."""
    d = tmp_path_factory.mktemp("qwen3_eagle3")
    hf = make_hf_model("qwen3", 5, vocab_size=V, num_hidden_layers=LAYERS, initializer_range=0.3)
    hf.save_pretrained(d / "target")
    # head seed 22: among 40 seeds tried, one whose random drafts get accepted on these prompts (4 tokens,
    # with the draft in float32 or in its CPU default w8a8_int8), so that accepted paths are committed
    return str(d / "target"), write_public_head(d / "eagle3", hf.config.to_dict(), seed=22)


@pytest.fixture(scope="module")
def eagle3_engine(dirs):
    """The target with its head as an EAGLE3 draft over a static 3/2/4 tree."""
    target, head = dirs
    return path_engine(
        target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_adaptive=False, **TREE
    )


def test_greedy_eagle3_is_token_identical_to_plain(dirs, eagle3_engine):
    """The head loads from its public names (the draft vocabulary through d2t, the target layers'
    features by the default capture), and greedy EAGLE3 over a static 3/2/4 tree emits plain greedy
    decoding's tokens, batched and alone, with some drafts accepted."""
    target, head = dirs
    plain = [r["output_ids"] for r in path_engine(target).generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    eng = eagle3_engine
    assert eng.proposer.draft_vocab == DRAFT_VOCAB and eng.proposer.capture_layers == (2, LAYERS // 2, LAYERS - 3)
    d2t = np.asarray(eng.dparams["draft"]["d2t"][...])
    np.testing.assert_array_equal(d2t, load_file(os.path.join(head, "model.safetensors"))["d2t"])  # int64 on disk
    out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in out] == plain
    assert [len(p) for p in plain] == [16, 16]
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in out)
    assert rounds < sum(len(p) for p in plain) - len(plain)  # some draft tokens were accepted
    assert eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"] == plain[1]


@pytest.mark.slow  # end to end (make test's 15 minutes)
def test_sampled_eagle3_emits_valid_tokens(eagle3_engine):
    """Speculative sampling at temperature 1 runs over the same head and emits in-vocabulary tokens
    (whether they follow the target's distribution is tests/test_speculative_sampling.py's part)."""
    sampled = dict(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=3)
    out = eagle3_engine.generate(input_ids=PROMPTS, sampling_params=sampled)
    for r in out:
        assert len(r["output_ids"]) == 16 and all(0 <= t < V for t in r["output_ids"])

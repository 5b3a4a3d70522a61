"""EAGLE-1/2 and EAGLE-3 draft heads against an independent numpy forward in the public layouts.

The other EAGLE tests write their heads with jaxspec's own exporter (`module_tensors` + `eagle_key`),
so a layout mistake shared by the exporter and the loader would pass them. Here the checkpoint is
built by hand under the public tensor names (SGLang `LlamaForCausalLMEagle` /
`LlamaForCausalLMEagle3`, SafeAILab EAGLE), the expected logits come from a pure-numpy forward that
reads those names directly, and jaxspec loads the same directory the way a user's
`speculative_draft_model_path` is loaded (Engine -> proposer).

Public layouts checked:
  EAGLE-1/2: fc([embed(x), hidden]) with fc.weight [H, 2H] + fc.bias (embedding half first), then one
    Llama decoder layer `layers.0.*` with no input_layernorm, no final norm; embedding and LM head
    are the target's. Its target feature is the target's final (normed) hidden state.
  EAGLE-3: hidden = fc(concat of 3 target residual streams) (fc.weight [H, 3H], no bias);
    attention input concat(input_layernorm(embeds), hidden_norm(hidden)) (q/k/v_proj [*, 2H]);
    residual = hidden (pre-norm); post_attention_layernorm + MLP; logits = lm_head(norm(out)) over
    the draft vocabulary, target id = draft id + d2t[draft id]; the pre-norm `out` is fed back as the
    next step's hidden (no fc then). Embedding from the target (a checkpoint's own is ignored).
    Its three features are the residual streams at the inputs of target layers [2, N//2, N-3].

Also checked: the numpy decoder layer reproduces transformers' Llama layer (so the reference's
RoPE / GQA / causal mask is right), jaxspec's target features equal the HF twin's hidden states,
the proposer path (extend -> root distribution, one fed-back step) matches, keys with and without a
"model." prefix load the same, and mutated checkpoints (fc halves swapped; the two EAGLE-3 input
norms swapped; the 3H feature blocks permuted) give logits far from the reference, so the
comparison is not vacuous.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from helpers import tiny_model

T = 7  # sequence length of the comparison
EPS = 1e-5
THETA = 50000.0  # the draft's own rope_theta (the tiny target uses 10000): the draft config must be read
INTER = 96  # the draft's own intermediate_size (the target's is 128)
DRAFT_VOCAB = 23


# ---- the numpy reference ------------------------------------------------------------------------


def rms(x, w, eps=EPS):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def lin(x, w, b=None):
    """HF Linear: weight [out, in]."""
    y = x @ w.T
    return y if b is None else y + b


def rope(x, theta):
    """x [T, N, D] at positions 0..T-1, rotate-half (HF) convention."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(t, dtype=np.float64)[:, None] * inv  # [T, D/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def attn(x, w, p, nh, nkv, theta):
    """Causal GQA self-attention over x [T, Din]; p = key prefix ("layers.0.self_attn.")."""
    t = x.shape[0]
    q = lin(x, w[p + "q_proj.weight"]).reshape(t, nh, -1)
    k = lin(x, w[p + "k_proj.weight"]).reshape(t, nkv, -1)
    v = lin(x, w[p + "v_proj.weight"]).reshape(t, nkv, -1)
    d = q.shape[-1]
    q, k = rope(q, theta), rope(k, theta)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # head h reads kv head h // rep
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", a, v).reshape(t, nh * d)
    return lin(o, w[p + "o_proj.weight"])


def mlp(x, w, p):
    g = lin(x, w[p + "gate_proj.weight"])
    return lin(g / (1 + np.exp(-g)) * lin(x, w[p + "up_proj.weight"]), w[p + "down_proj.weight"])


def llama_layer(x, w, p, nh, nkv, theta, eps=EPS):
    """One HF Llama decoder layer (pre-norm); no input_layernorm if its weight is absent (EAGLE-1)."""
    xn = rms(x, w[p + "input_layernorm.weight"], eps) if p + "input_layernorm.weight" in w else x
    x = x + attn(xn, w, p + "self_attn.", nh, nkv, theta)
    return x + mlp(rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp.")


def eagle1_reference(w, embeds, hidden, nh, nkv, theta):
    """-> draft output hidden [T, H] (fed back and given to the target's LM head, no norm)."""
    x = lin(np.concatenate([embeds, hidden], -1), w["fc.weight"], w["fc.bias"])
    return llama_layer(x, w, "layers.0.", nh, nkv, theta)


def eagle3_reference(w, embeds, hidden, nh, nkv, theta):
    """hidden [T, 3H] target features or [T, H] fed back -> (draft-vocab logits [T, Vd], pre-norm out [T, H])."""
    if hidden.shape[-1] != embeds.shape[-1]:
        hidden = lin(hidden, w["fc.weight"])
    m = "midlayer."
    x = np.concatenate([rms(embeds, w[m + "input_layernorm.weight"]), rms(hidden, w[m + "hidden_norm.weight"])], -1)
    residual = hidden + attn(x, w, m + "self_attn.", nh, nkv, theta)
    out = residual + mlp(rms(residual, w[m + "post_attention_layernorm.weight"]), w, m + "mlp.")
    return lin(rms(out, w["norm.weight"]), w["lm_head.weight"]), out


def to_target_logits(draft_logits, d2t, vocab):
    """Draft-vocab logits -> target-vocab logits (-inf outside the draft vocabulary)."""
    out = np.full(draft_logits.shape[:-1] + (vocab,), -np.inf)
    out[..., np.arange(len(d2t)) + d2t] = draft_logits
    return out


# ---- hand-built public checkpoints ------------------------------------------------------------


def _layer_tensors(rng, p, din, h, nh, nkv, hd, inter):
    g = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
    return {
        p + "self_attn.q_proj.weight": g(nh * hd, din),
        p + "self_attn.k_proj.weight": g(nkv * hd, din),
        p + "self_attn.v_proj.weight": g(nkv * hd, din),
        p + "self_attn.o_proj.weight": g(h, nh * hd),
        p + "mlp.gate_proj.weight": g(inter, h),
        p + "mlp.up_proj.weight": g(inter, h),
        p + "mlp.down_proj.weight": g(h, inter),
        p + "post_attention_layernorm.weight": (1 + 0.3 * rng.standard_normal(h)).astype(np.float32),
    }


def public_weights(kind, tcfg, seed=0):
    """Random tensors under the public names (no "model." prefix, as SafeAILab / SpecForge save them)."""
    rng = np.random.default_rng(seed)
    h, v = tcfg["hidden_size"], tcfg["vocab_size"]
    nh, nkv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd = h // nh
    norm = lambda: (1 + 0.3 * rng.standard_normal(h)).astype(np.float32)
    if kind == "EAGLE":
        w = {
            "fc.weight": (rng.standard_normal((h, 2 * h)) / np.sqrt(2 * h)).astype(np.float32),
            "fc.bias": (0.1 * rng.standard_normal(h)).astype(np.float32),
        }
        w.update(_layer_tensors(rng, "layers.0.", h, h, nh, nkv, hd, INTER))
        # some EAGLE-1 checkpoints carry an lm_head; SGLang skips it and uses the target's (this one differs)
        w["lm_head.weight"] = rng.standard_normal((v, h)).astype(np.float32)
        return w
    w = {"fc.weight": (rng.standard_normal((h, 3 * h)) / np.sqrt(3 * h)).astype(np.float32)}
    w.update(_layer_tensors(rng, "midlayer.", 2 * h, h, nh, nkv, hd, INTER))
    w["midlayer.input_layernorm.weight"] = norm()
    w["midlayer.hidden_norm.weight"] = norm()
    w["norm.weight"] = norm()
    w["lm_head.weight"] = (3 * rng.standard_normal((DRAFT_VOCAB, h)) / np.sqrt(h)).astype(np.float32)
    ids = np.sort(rng.choice(v, DRAFT_VOCAB, replace=False))
    w["d2t"] = (ids - np.arange(DRAFT_VOCAB)).astype(np.int64)
    w["t2d"] = np.isin(np.arange(v), ids)
    # some EAGLE-3 heads ship an embedding; SGLang replaces it with the target's
    w["embed_tokens.weight"] = rng.standard_normal((v, h)).astype(np.float32)
    return w


def write_head(path, kind, tcfg, w, prefix=""):
    """prefix "model." is put on every key but lm_head / d2t / t2d (the other layout seen in the wild)."""
    cfg = dict(
        architectures=["LlamaForCausalLMEagle" if kind == "EAGLE" else "LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=tcfg["hidden_size"],
        intermediate_size=INTER,
        num_attention_heads=tcfg["num_attention_heads"],
        num_key_value_heads=tcfg["num_key_value_heads"],
        num_hidden_layers=1,
        hidden_act="silu",
        rms_norm_eps=EPS,
        rope_theta=THETA,
        max_position_embeddings=2048,
        vocab_size=tcfg["vocab_size"],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    if kind == "EAGLE3":
        cfg["draft_vocab_size"] = DRAFT_VOCAB
    os.makedirs(path, exist_ok=True)
    keep = ("lm_head.weight", "d2t", "t2d")
    save_file(
        {(k if k in keep else prefix + k): np.ascontiguousarray(a) for k, a in w.items()},
        os.path.join(path, "model.safetensors"),
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


# ---- jaxspec side -------------------------------------------------------------------------------


def load_jaxspec(kind, target, path):
    """The user's path: an Engine with speculative_algorithm + speculative_draft_model_path."""
    from jaxspec.engine import Engine

    eng = Engine.from_model(
        target,
        speculative_algorithm=kind,
        speculative_draft_model_path=path,
        show_progress=False,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
        speculative_draft_model_quantization="unquant",  # the float draft (on CPU it runs in int8 by default)
    )
    return eng.proposer, eng.dparams


def jaxspec_forward(prop, dparams, tgt, tokens, feats):
    """The head over T entries at positions 0..T-1 of an empty draft cache (what the proposer's
    prefill / extend run) -> (draft hidden for the LM head [T, H], fed-back hidden [T, H])."""
    from flax import nnx

    head = nnx.merge(prop.graphdef, dparams["draft"])
    cache = prop.make_cache(1, 32, jnp.float32)
    pos = jnp.arange(len(tokens), dtype=jnp.int32)[None]
    embeds = tgt.embed_tokens[...][jnp.asarray(tokens)[None]]
    lh, fb, _ = head(embeds, jnp.asarray(feats, jnp.float32)[None], pos, cache)
    return head, lh[0], fb[0]


def jaxspec_target_features(prop, tgt, tokens):
    """The target forward as the engine runs it -> (captured [3, T, H] | None, final hidden [T, H])."""
    from jaxspec.cache import KVCache

    cache = KVCache.create(tgt.cfg, 1, 32, jnp.float32)
    h, _, cap = tgt(
        jnp.asarray([tokens], jnp.int32),
        jnp.arange(len(tokens), dtype=jnp.int32)[None],
        cache,
        capture_layers=prop.capture_layers,
    )
    f = prop.features(h, cap)
    return (None if cap is None else np.asarray(f[0])), np.asarray(h[0])


def proposer_round(prop, dparams, tgt, tokens, feats, next_token):
    """extend over the T entries (root distribution from the last), then one draft step that feeds
    the root hidden back with `next_token` at position T -> (root probs [Vd], step probs [Vd])."""
    from jaxspec.speculative.proposers.base import DraftState

    h = tgt.cfg.hidden_size
    state = DraftState(prop.make_cache(1, 32, jnp.float32), jnp.zeros((1, prop.draft_vocab)), jnp.zeros((1, h)))
    state = prop.extend(
        dparams,
        tgt,
        state,
        jnp.asarray(tokens, jnp.int32)[None],
        jnp.asarray(feats, jnp.float32)[None],
        jnp.asarray([len(tokens)], jnp.int32),
        jnp.asarray([True]),
    )
    mask = jnp.ones((1, 1, 1), bool)
    probs, _, _ = prop.step(
        dparams, tgt, state, jnp.asarray([[next_token]], jnp.int32), state.root_hidden[:, None], 1, mask, 0
    )
    return np.asarray(state.root_probs[0]), np.asarray(probs[0, 0])


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rel_err(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / max(1.0, np.max(np.abs(ref))))


TOL = 1e-4


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target1():
    return tiny_model("llama", seed=11)


@pytest.fixture(scope="module")
def target3():
    # 8 layers: the default EAGLE-3 capture [2, N//2, N-3] = (2, 4, 5) is three distinct layers
    return tiny_model("llama", seed=13, num_hidden_layers=8)


def target_dims(hf):
    """(config dict, attention heads, KV heads, vocabulary size, layers) of a target's HF twin."""
    c = hf.config.to_dict()
    return c, c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"], c["num_hidden_layers"]


def hf_hidden_states(hf, tokens):
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    # hidden_states[i] = input of layer i (i < N); the last entry is after the final norm
    return [s[0].double().numpy() for s in out.hidden_states]


# ---- tests ----------------------------------------------------------------------------------------


def test_numpy_layer_matches_transformers(target1):
    """The reference decoder layer reproduces transformers' Llama layer 0 (RoPE, GQA, causal mask)."""
    _, hf = target1
    c = hf.config
    tokens = list(np.random.default_rng(0).integers(0, c.vocab_size, T))
    hs = hf_hidden_states(hf, tokens)
    sd = {k[len("model.") :]: v.double().numpy() for k, v in hf.state_dict().items() if k.startswith("model.")}
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta
    out = llama_layer(hs[0], sd, "layers.0.", c.num_attention_heads, c.num_key_value_heads, theta, c.rms_norm_eps)
    assert rel_err(out, hs[1]) < TOL


@pytest.mark.parametrize("prefix", ["", "model."])
def test_eagle1_matches_reference(target1, tmp_path, prefix):
    tgt, hf = target1
    tcfg = hf.config.to_dict()
    nh, nkv, v = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["vocab_size"]
    w = public_weights("EAGLE", tcfg, seed=1)
    prop, dparams = load_jaxspec("EAGLE", tgt, write_head(tmp_path / "eagle", "EAGLE", tcfg, w, prefix))
    assert prop.draft_vocab == v and prop.capture_layers == ()

    rng = np.random.default_rng(2)
    tokens = [int(t) for t in rng.integers(0, v, T)]
    hs = hf_hidden_states(hf, tokens)
    feats = hs[-1]  # the target's final normed hidden (HF), the EAGLE-1/2 feature
    emb = hf.model.embed_tokens.weight.detach().double().numpy()
    w64 = {k: a.astype(np.float64) for k, a in w.items()}
    ref_h = eagle1_reference(w64, emb[tokens], feats, nh, nkv, THETA)
    head_w = hf.lm_head.weight.detach().double().numpy()  # the target's LM head, not the checkpoint's
    ref = lin(ref_h, head_w)

    # jaxspec's target feature is the same as HF's
    _, h_tgt = jaxspec_target_features(prop, tgt, tokens)
    assert rel_err(h_tgt, feats) < TOL

    _, lh, fb = jaxspec_forward(prop, dparams, tgt, tokens, feats)
    got = np.asarray(tgt.logits(lh))
    assert rel_err(got, ref) < TOL, rel_err(got, ref)
    assert rel_err(fb, ref_h) < TOL

    # the proposer round: root distribution from the last entry, then one step with the fed-back hidden
    nxt = int(rng.integers(0, v))
    ref_step_h = eagle1_reference(w64, emb[tokens + [nxt]], np.concatenate([feats, ref_h[-1:]]), nh, nkv, THETA)
    root, step = proposer_round(prop, dparams, tgt, tokens, feats, nxt)
    assert np.max(np.abs(root - softmax(ref[-1]))) < TOL
    assert np.max(np.abs(step - softmax(lin(ref_step_h[-1], head_w)))) < TOL


@pytest.mark.parametrize("prefix", ["", "model."])
def test_eagle3_matches_reference(target3, tmp_path, prefix):
    tgt, hf = target3
    tcfg, nh, nkv, v, n = target_dims(hf)
    w = public_weights("EAGLE3", tcfg, seed=3)
    prop, dparams = load_jaxspec("EAGLE3", tgt, write_head(tmp_path / "eagle3", "EAGLE3", tcfg, w, prefix))
    assert prop.draft_vocab == DRAFT_VOCAB
    assert prop.capture_layers == (2, n // 2, n - 3)

    rng = np.random.default_rng(4)
    tokens = [int(t) for t in rng.integers(0, v, T)]
    hs = hf_hidden_states(hf, tokens)
    feats = np.concatenate([hs[i] for i in (2, n // 2, n - 3)], -1)  # residual streams at those layers' inputs
    f_jax, _ = jaxspec_target_features(prop, tgt, tokens)
    assert rel_err(f_jax, feats) < TOL

    emb = hf.model.embed_tokens.weight.detach().double().numpy()  # the target's, not the checkpoint's
    w64 = {k: (a if a.dtype.kind in "ib" else a.astype(np.float64)) for k, a in w.items()}
    ref, ref_out = eagle3_reference(w64, emb[tokens], feats, nh, nkv, THETA)

    head, lh, fb = jaxspec_forward(prop, dparams, tgt, tokens, feats)
    got = np.asarray(head.logits(lh))
    assert got.shape == (T, DRAFT_VOCAB)
    assert rel_err(got, ref) < TOL, rel_err(got, ref)
    assert rel_err(fb, ref_out) < TOL

    # draft ids -> target ids through d2t
    d2t = w["d2t"]
    draft_ids = np.arange(DRAFT_VOCAB)
    assert np.array_equal(np.asarray(prop.to_target(dparams, jnp.asarray(draft_ids))), draft_ids + d2t)
    ref_t = to_target_logits(ref, d2t, v)
    assert np.array_equal(np.asarray(prop.to_target(dparams, jnp.asarray(got.argmax(-1)))), ref_t.argmax(-1))
    assert np.array_equal(np.flatnonzero(w["t2d"]), draft_ids + d2t)  # the hand-built maps agree with each other

    # the proposer round; the step feeds back the pre-norm output (H wide: no fc)
    nxt = int(rng.integers(0, v))
    root, step = proposer_round(prop, dparams, tgt, tokens, feats, nxt)
    ref_step = step_reference_eagle3(w64, emb, tokens + [nxt], feats, ref_out[-1], nh, nkv)
    assert np.max(np.abs(root - softmax(ref[-1]))) < TOL
    assert np.max(np.abs(step - softmax(ref_step))) < TOL


def step_reference_eagle3(w, emb, tokens, feats, fed_back, nh, nkv):
    """Draft-vocab logits of entry T (token tokens[T], hidden = the fed-back pre-norm out, used as is)
    attending over entries 0..T-1 (hidden = fc(target features)) and itself."""
    hid = np.concatenate([lin(feats, w["fc.weight"]), fed_back[None]])
    logits, _ = eagle3_reference(w, emb[tokens], hid, nh, nkv, THETA)
    return logits[-1]


def test_exported_eagle3_head_reads_in_the_public_layout(target3, tmp_path):
    """What `jaxspec train-draft` exports is what SGLang's LlamaForCausalLMEagle3 reads: the public
    tensor names (those a hand-built public checkpoint has, less the optional embedding), the
    config fields, and tensors that, read by the numpy reference above (not by jaxspec's loader),
    give the trained head's own logits and fed-back hidden state."""
    from flax import nnx
    from safetensors.numpy import load_file

    from jaxspec.loader import LoadedModel
    from jaxspec.train.data import Example
    from jaxspec.train.trainer import TrainConfig, Trainer

    tgt, hf = target3
    tcfg, nh, nkv, v, n = target_dims(hf)
    rng = np.random.default_rng(5)
    examples = [Example([int(t) for t in rng.integers(0, v, 24)], [0] * 8 + [1] * 16) for _ in range(8)]
    cfg = TrainConfig(algorithm="EAGLE3", steps=3, batch_size=4, max_len=32, draft_vocab_size=DRAFT_VOCAB, seed=1)
    loaded = LoadedModel(tgt.cfg, tgt, None, "<memory>", "memory")
    tr = Trainer(loaded, tcfg, examples, cfg, str(tmp_path), progress=False)
    tr.train()
    tr.export("float32")

    w = load_file(str(tmp_path / "model.safetensors"))
    public = set(public_weights("EAGLE3", tcfg)) - {"embed_tokens.weight"}
    assert set(w) == public, set(w) ^ public
    with open(tmp_path / "config.json") as f:
        c = json.load(f)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["draft_vocab_size"] == DRAFT_VOCAB == w["lm_head.weight"].shape[0] == len(w["d2t"])
    assert w["t2d"].shape == (v,) and np.array_equal(np.flatnonzero(w["t2d"]), np.arange(DRAFT_VOCAB) + w["d2t"])
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps"):
        assert c[k] == tcfg[k], k
    assert w["fc.weight"].shape == (tcfg["hidden_size"], 3 * tcfg["hidden_size"])

    tokens = [int(t) for t in rng.integers(0, v, T)]
    feats = np.concatenate([hf_hidden_states(hf, tokens)[i] for i in (2, n // 2, n - 3)], -1)
    emb = hf.model.embed_tokens.weight.detach().double().numpy()
    w64 = {k: (a if a.dtype.kind in "ib" else a.astype(np.float64)) for k, a in w.items()}
    ref, ref_out = eagle3_reference(w64, emb[tokens], feats, nh, nkv, c["rope_theta"])

    head = nnx.merge(tr.graphdef, tr.params, tr.rest)  # the trained head, in memory
    prop, _ = load_jaxspec("EAGLE3", tgt, str(tmp_path))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    embeds = tgt.embed_tokens[...][jnp.asarray(tokens)[None]]
    lh, fb, _ = head(embeds, jnp.asarray(feats, jnp.float32)[None], pos, prop.make_cache(1, 32, jnp.float32))
    assert rel_err(np.asarray(head.logits(lh[0])), ref) < TOL
    assert rel_err(np.asarray(fb[0]), ref_out) < TOL


# ---- the comparison can fail ------------------------------------------------------------------


def _swap_fc_halves(w, h):
    w = dict(w)
    w["fc.weight"] = np.concatenate([w["fc.weight"][:, h:], w["fc.weight"][:, :h]], 1)
    return w


def _swap_eagle3_norms(w, h):
    w = dict(w)
    w["midlayer.input_layernorm.weight"], w["midlayer.hidden_norm.weight"] = (
        w["midlayer.hidden_norm.weight"],
        w["midlayer.input_layernorm.weight"],
    )
    return w


def _permute_eagle3_features(w, h):
    w = dict(w)
    f = w["fc.weight"]
    w["fc.weight"] = np.concatenate([f[:, 2 * h :], f[:, :h], f[:, h : 2 * h]], 1)
    return w


def _swap_eagle3_qkv_halves(w, h):
    w = dict(w)
    for p in ("q", "k", "v"):
        k = f"midlayer.self_attn.{p}_proj.weight"
        w[k] = np.concatenate([w[k][:, h:], w[k][:, :h]], 1)
    return w


@pytest.mark.parametrize(
    "kind,mutate",
    [
        ("EAGLE", _swap_fc_halves),
        ("EAGLE3", _swap_eagle3_norms),
        ("EAGLE3", _permute_eagle3_features),
        ("EAGLE3", _swap_eagle3_qkv_halves),
    ],
)
def test_mutated_checkpoint_is_detected(target1, target3, tmp_path, kind, mutate):
    """A checkpoint with a layout mistake loads fine but its logits are far from the reference."""
    tgt, hf = target1 if kind == "EAGLE" else target3
    tcfg = hf.config.to_dict()
    nh, nkv, v, h = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["vocab_size"], tcfg["hidden_size"]
    w = public_weights(kind, tcfg, seed=5)
    prop, dparams = load_jaxspec(kind, tgt, write_head(tmp_path / "bad", kind, tcfg, mutate(w, h)))
    tokens = [int(t) for t in np.random.default_rng(6).integers(0, v, T)]
    hs = hf_hidden_states(hf, tokens)
    feats = hs[-1] if kind == "EAGLE" else np.concatenate([hs[i] for i in prop.capture_layers], -1)
    emb = hf.model.embed_tokens.weight.detach().double().numpy()
    w64 = {k: (a if a.dtype.kind in "ib" else a.astype(np.float64)) for k, a in w.items()}  # the unmutated tensors
    head, lh, _ = jaxspec_forward(prop, dparams, tgt, tokens, feats)
    if kind == "EAGLE":
        ref = lin(
            eagle1_reference(w64, emb[tokens], feats, nh, nkv, THETA), hf.lm_head.weight.detach().double().numpy()
        )
        got = np.asarray(tgt.logits(lh))
    else:
        ref, _ = eagle3_reference(w64, emb[tokens], feats, nh, nkv, THETA)
        got = np.asarray(head.logits(lh))
    assert rel_err(got, ref) > 100 * TOL, rel_err(got, ref)

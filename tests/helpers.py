"""What several test modules share, in one place instead of imports from conftest.py or from other
test modules: tiny random HF models of each family built with torch (the reference) and random
EAGLE / EAGLE-3 heads and MTP tensors for them; GGUF files of such models (`write_gguf`); the tiny speculative-decoding setup of
tests/test_speculative.py (a 16-token vocabulary, its prompts, the `models` and `plain` fixtures,
an `engine` factory) with the chi-square check that sampled tokens follow the target distribution;
a real uvicorn server over a tiny target with SmolLM2's tokenizer (the `model_dirs` fixture,
`Server`, `start`, `serve_subprocess`); and `resolve_spec` / `ngram_config`, which build
`SpecConfig` / `NgramConfig` from short flag names. The fixtures here are module-scoped and take
effect in a module that imports them (each such module builds its own); heavy libraries (torch,
JAX, jaxspec) are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

# ---- tiny random models -------------------------------------------------------------------------

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True)

# family -> (transformers config class name, model class name, extra config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama_tied_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1),
    ),
    "llama31": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # per-head q/k norms; head_dim 32 != hidden / heads = 16
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3_untied_linear": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=32, tie_word_embeddings=False, rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e6)
        ),
    ),
    # Qwen3 attention, 8 experts (top 2) in layer 1, a dense MLP in layer 0 (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=32, tie_word_embeddings=True, **MOE)),
    # three layers, the middle one sparse (decoder_sparse_step 2); top-k weights not renormalised
    "qwen3_moe_step2": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            **{**MOE, "mlp_only_layers": [], "norm_topk_prob": False},
            decoder_sparse_step=2,
            num_hidden_layers=3,
        ),
    ),
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
            elif n.endswith("mlp.gate.weight"):  # MoE routers: clear top-k choices, not near-ties
                p.copy_(torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def tiny_model(family="llama", seed=0, **overrides):
    """A tiny random jaxspec model (via its HF twin, so it is a valid checkpoint too)."""
    from jaxspec.config import ModelConfig
    from jaxspec.models.params import load_model

    m = make_hf_model(family, seed, **overrides)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    cfg = ModelConfig.from_hf(m.config.to_dict())
    return load_model(cfg, sd.keys(), sd.__getitem__, progress=False), m


def save_eagle_head(
    path,
    kind: str,
    target_hf_config: dict,
    seed: int = 0,
    draft_vocab: int | None = None,
    scale: float = 1.0,
    aux_layer_ids=None,
):
    """Writes a random EAGLE ("EAGLE") or EAGLE-3 ("EAGLE3") head in the public checkpoint layout."""
    import json
    import os

    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxspec.models.eagle import build_eagle, eagle_config, eagle_key
    from jaxspec.models.params import module_tensors

    arch = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}[kind]
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
        "head_dim",
    )
    cfg = {k: target_hf_config[k] for k in keep if target_hf_config.get(k) is not None}
    cfg.update(
        architectures=[arch], model_type="llama", num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False
    )
    if kind == "EAGLE3":
        cfg["draft_vocab_size"] = draft_vocab or cfg["vocab_size"]
        if aux_layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    _, mcfg, extra = eagle_config(cfg)
    head = build_eagle(kind, mcfg, extra, jnp.float32, nnx.Rngs(seed))
    t = module_tensors(head, eagle_key)
    rng = np.random.default_rng(seed)
    for k in t:
        if t[k].dtype == np.float32 and not k.endswith("norm.weight"):
            t[k] = t[k] * scale
    if kind == "EAGLE3":
        v, dv = cfg["vocab_size"], cfg["draft_vocab_size"]
        ids = np.sort(rng.choice(v, dv, replace=False))
        t["d2t"] = (ids - np.arange(dv)).astype(np.int64)
        t["t2d"] = np.isin(np.arange(v), ids)
    os.makedirs(path, exist_ok=True)
    save_file(
        {("model." + k if k.startswith("layers") else k): v for k, v in t.items()},
        os.path.join(path, "model.safetensors"),
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


# ---- GGUF files (tests/test_gguf_blocks.py, tests/test_qwen3.py) ----------------------------------


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """w [..., I] float -> GGUF blocks of type `kind` (Q4_0, Q8_0, ...) by the `gguf` package; a type
    it cannot write (Q8_1, ...) gets zero blocks of that type's size, for files that must be refused."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape
    from gguf.quants import quantize as q

    qtype = getattr(GGMLQuantizationType, kind)
    try:
        return q(np.ascontiguousarray(w, np.float32), qtype)
    except NotImplementedError:
        return np.zeros(quant_shape_to_byte_shape(w.shape, qtype), np.uint8)


# HF per-layer module -> llama.cpp's GGUF tensor name part (q/k norms: Qwen3 only)
GGUF_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_gguf(hf_model, path: str, kinds: dict[str, str]) -> str:
    """A llama, qwen2, qwen3 or qwen3moe GGUF file of `hf_model` (torch) with llama.cpp's tensor
    names, metadata and q/k row order (permuted for llama only); kinds: GGUF tensor name part
    (token_embd, attn_q, ffn_down, ffn_gate_exps, ...) -> type (default Q8_0 for matrices and
    expert stacks; norms and MoE routers F32, as llama.cpp's converter keeps them)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    permute = lambda w, n: w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    # llama, or qwen2 / qwen3 / qwen3moe (whose q/k rows llama.cpp leaves in place)
    arch = {"qwen3_moe": "qwen3moe"}.get(cfg.model_type, cfg.model_type)
    wr = GGUFWriter(path, arch)
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    if getattr(cfg, "head_dim", None):  # as llama.cpp's converter writes a config's head_dim
        wr.add_key_length(cfg.head_dim)
        wr.add_value_length(cfg.head_dim)
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    wr.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    wr.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":  # what llama.cpp's converter writes (no expert_weights_norm: llama.cpp renormalises)
        wr.add_expert_count(cfg.num_experts)
        wr.add_expert_used_count(cfg.num_experts_per_tok)
        wr.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    def add(name: str, part: str, w: np.ndarray):
        kind = kinds.get(part, "Q8_0" if w.ndim >= 2 and part != "ffn_gate_inp" else "F32")
        if kind in ("F32", "F16"):
            wr.add_tensor(name, w.astype(np.float32 if kind == "F32" else np.float16))
        else:
            wr.add_tensor(name, quantize(w, kind), raw_dtype=getattr(GGMLQuantizationType, kind))

    add("token_embd.weight", "token_embd", sd["model.embed_tokens.weight"])
    add("output_norm.weight", "output_norm", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        add("output.weight", "output", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, part in GGUF_PARTS.items():
            if f"model.layers.{i}.{hf}.weight" not in sd:
                continue
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if arch == "llama":
                w = permute(w, heads) if part == "attn_q" else permute(w, kv_heads) if part == "attn_k" else w
            add(f"blk.{i}.{part}.weight", part, w)
            if f"model.layers.{i}.{hf}.bias" in sd:
                wr.add_tensor(f"blk.{i}.{part}.bias", sd[f"model.layers.{i}.{hf}.bias"].astype(np.float32))
        for part, w in gguf_experts(sd, i).items():
            add(f"blk.{i}.{part}.weight", part, w)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def gguf_experts(sd: dict, layer: int) -> dict[str, np.ndarray]:
    """llama.cpp's MoE tensors of HF state dict `sd`'s layer (none for a dense layer): the router
    ffn_gate_inp [E, H], and the experts stacked, ffn_gate_exps / ffn_up_exps [E, I, H] and
    ffn_down_exps [E, H, I], from transformers' in-memory gate_up_proj [E, 2I, H] (gate rows first)
    and down_proj [E, H, I], or from per-expert tensors."""
    p = f"model.layers.{layer}.mlp."
    if p + "gate.weight" not in sd:
        return {}
    if p + "experts.gate_up_proj" in sd:
        gate_up = sd[p + "experts.gate_up_proj"]
        gate, up = np.split(gate_up, 2, axis=1)
        down = sd[p + "experts.down_proj"]
    else:
        e = sd[p + "gate.weight"].shape[0]
        gate, up, down = (np.stack([sd[f"{p}experts.{i}.{q}.weight"] for i in range(e)]) for q in PROJS)
    return {"ffn_gate_inp": sd[p + "gate.weight"], "ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down}


PROJS = ("gate_proj", "up_proj", "down_proj")


# ---- speculative decoding on a tiny target (tests/test_speculative.py) -------------------------

V = 16  # a small vocabulary so that random drafts get accepted often enough to exercise commits
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4], [4], [2, 3, 4, 5, 6, 7]]
GREEDY = dict(temperature=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    tgt = make_hf_model("llama", 3, vocab_size=V, num_hidden_layers=4, initializer_range=0.3)
    tgt.save_pretrained(d / "target")
    make_hf_model("llama", 5, vocab_size=V, num_hidden_layers=1, initializer_range=0.3).save_pretrained(d / "small")
    make_hf_model("llama", 3, vocab_size=V, num_hidden_layers=4, initializer_range=1.0).save_pretrained(d / "sharp")
    cfg = tgt.config.to_dict()
    return {
        "target": str(d / "target"),
        "small": str(d / "small"),
        "sharp": str(d / "sharp"),
        "eagle": save_eagle_head(d / "eagle", "EAGLE", cfg, seed=1, scale=10.0),
        "eagle3": save_eagle_head(
            d / "eagle3", "EAGLE3", cfg, seed=2, draft_vocab=12, scale=10.0, aux_layer_ids=[0, 1, 2]
        ),
        "hf": tgt,
    }


def engine(models, algo=None, draft=None, knobs=None, target="target", **kw):
    from jaxspec.engine import Engine

    spec = {}
    if algo:
        spec = dict(speculative_algorithm=algo, speculative_draft_model_path=models[draft])
        if knobs:
            spec.update(
                speculative_num_steps=knobs[0], speculative_eagle_topk=knobs[1], speculative_num_draft_tokens=knobs[2]
            )
    return Engine(models[target], skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=4, **spec, **kw)


@pytest.fixture(scope="module")
def plain(models):
    eng = engine(models)
    return {len(p): r["output_ids"] for p, r in zip(PROMPTS, eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))}


def exact_pair_distribution(hf, prompt, temperature):
    """P(t1, t2) of the 2nd and 3rd generated tokens under the target (torch reference), t0 summed out."""
    import torch

    with torch.no_grad():
        p = lambda ids: torch.softmax(hf(torch.tensor(ids)).logits[:, -1] / temperature, -1).numpy()
        p0 = p([prompt])[0]
        p1 = p([prompt + [a] for a in range(V)])  # [t0, t1]
        p2 = p([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)  # [t0, t1, t2]
    return np.einsum("a,ab,abc->bc", p0, p1, p2)


def sample_pairs(eng, prompt, n, temperature):
    seeds = np.arange(n)
    out = eng.generate(
        input_ids=[prompt] * n,
        sampling_params=[dict(temperature=temperature, max_new_tokens=3, ignore_eos=True, seed=int(s)) for s in seeds],
    )
    counts = np.zeros((V, V))
    for r in out:
        counts[r["output_ids"][1], r["output_ids"][2]] += 1
    return counts


def chi2_pvalue(counts, probs):
    from scipy.stats import chisquare

    n = counts.sum()
    exp = probs.reshape(-1) * n
    obs = counts.reshape(-1)
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    return chisquare(o, e * o.sum() / e.sum()).pvalue


# ---- MTP modules (tests/test_mtp.py) ------------------------------------------------------------


def mtp_tensors(kind: str, config: dict, prefix: str, seed: int, scale: float = 8.0) -> dict:
    """Random MTP tensors under `prefix` (large weights so that the draft is confident and often right
    by chance over a 16-token vocabulary), plus the shared tensors a real checkpoint carries."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec.models.mtp import build_mtp, mtp_config, mtp_key
    from jaxspec.models.params import module_tensors

    head = build_mtp(kind, mtp_config(config), jnp.float32, nnx.Rngs(seed))
    t = module_tensors(head, mtp_key(prefix))
    t = {k: (v if "norm" in k else v * scale) for k, v in t.items()}
    if kind == "NEXTN":  # present in DeepSeek checkpoints, shared with the target (ignored on load)
        h = config["hidden_size"]
        t[prefix + "embed_tokens.weight"] = np.zeros((V, h), np.float32)
        t[prefix + "shared_head.head.weight"] = np.zeros((V, h), np.float32)
    return t


def add_mtp_modules(path, kind: str, count: int = 1, seed: int = 7) -> None:
    """Turns the HF checkpoint directory `path` into one that carries `count` random MTP modules of
    `kind` (module i seeded seed + i) after its layers: NEXTN at `model.layers.{num_hidden_layers + i}.`
    with num_nextn_predict_layers, MIMO at `model.mtp_layers.{i}.` with MiMo's architecture."""
    from safetensors.numpy import save_file

    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if kind == "NEXTN":
        cfg["num_nextn_predict_layers"] = count
        prefixes = [f"model.layers.{cfg['num_hidden_layers'] + i}." for i in range(count)]
    else:
        cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=count)
        prefixes = [f"model.mtp_layers.{i}." for i in range(count)]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tensors: dict = {}
    for i, prefix in enumerate(prefixes):
        tensors.update(mtp_tensors(kind, cfg, prefix, seed=seed + i))
    save_file(tensors, os.path.join(path, "model-mtp.safetensors"))


# ---- `jaxspec serve` over HTTP (tests/test_server.py) -------------------------------------------

KEY = "sk-test"


def straight_line_sampler(monkeypatch) -> None:
    """Programs traced from here on build the sampler as for a GPU: every branch computed, no
    conditional (jaxspec.sampling.SKIP_UNUSED). Traces made before are dropped, so that no program
    of the CPU form is taken from jax's caches."""
    import jax

    from jaxspec import sampling

    monkeypatch.setattr(sampling, "SKIP_UNUSED", False)
    jax.clear_caches()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny random target and draft with the real SmolLM2 tokenizer (so chat templates work)."""
    from transformers import AutoTokenizer

    from jaxspec.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path(progress=False))
    d = tmp_path_factory.mktemp("serve")
    kw = dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.2,
        max_position_embeddings=512,
    )
    for name, seed, layers in (("target", 3, 2), ("draft", 4, 1)):
        make_hf_model("llama", seed, num_hidden_layers=layers, **kw).save_pretrained(d / name)
        tok.save_pretrained(d / name)
    return {"target": str(d / "target"), "draft": str(d / "draft")}


class Server:
    def __init__(self, app, sched):
        import uvicorn

        self.port = free_port()
        self.sched = sched
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t = time.time()
        while not self.server.started:
            assert time.time() - t < 60 and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def request(self, method, path, body=None, headers=None, raw: bytes | None = None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        text = r.read().decode()
        c.close()
        try:
            return r.status, json.loads(text), dict(r.getheaders())
        except json.JSONDecodeError:
            return r.status, text, dict(r.getheaders())

    def stream(self, path, body):
        """SSE events (parsed JSON) until [DONE]."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        c.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Authorization": f"Bearer {KEY}"})
        r = c.getresponse()
        assert r.status == 200, r.read()
        events = []
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
        c.close()
        return events

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.sched.shutdown()


def start(model_dirs, **flags):
    from jaxspec.cli import build_parser
    from jaxspec.server.launch import build

    argv = [
        "serve",
        "--model-path",
        model_dirs["target"],
        "--api-key",
        KEY,
        "--context-length",
        "256",
        "--log-level",
        "error",
    ]
    if not flags.pop("background_compile", False):  # spare the 2 test cores
        argv.append("--disable-background-compile")
    for k, v in flags.items():  # (False: a switch's --no- form)
        name = k.replace("_", "-")
        argv += [f"--no-{name}"] if v is False else [f"--{name}"] + ([] if v is True else [str(v)])
    app, sched = build(build_parser().parse_args(argv), progress=False)
    return Server(app, sched)


def serve_process(flags: list[str], port: int, **env: str) -> subprocess.Popen:
    """`python -m jaxspec.cli serve --port PORT FLAGS` on the CPU (env: more variables), stdout
    and stderr merged into p.stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "jaxspec.cli", "serve", "--port", str(port)] + flags,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
        text=True,
    )


def wait_ready(procs: list[subprocess.Popen], port: int, ready: str = "/health", timeout: float = 120) -> None:
    """Returns once `ready` answers 200 on `port` (within `timeout` seconds); raises with the output
    of any of `procs` that exits first, and kills them all on a timeout."""
    t = time.time()
    while True:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(p.stdout.read())
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", ready)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.time() - t > timeout:
            for p in procs:
                p.kill()
            raise AssertionError(f"jaxspec serve did not answer {ready} within {timeout:.0f} s")
        time.sleep(0.3)


def serve_subprocess(
    flags: list[str], port: int | None = None, ready: str = "/health", timeout: float = 120
) -> tuple[subprocess.Popen, int]:
    """serve_process on `port` (default: a free one), returned once `ready` answers 200 (within
    `timeout` seconds): (the process, its port)."""
    port = port or free_port()
    p = serve_process(flags, port)
    wait_ready([p], port, ready, timeout)
    return p, port


# ---- speculative configs from short flag names ----------------------------------------------------


def resolve_spec(algorithm, target=None, bundled=None, ngram=None, **short):
    """`SpecConfig.resolve` with the flags by their short names: `draft_model_path`, `num_steps`,
    `eagle_topk`, `num_draft_tokens`, `accept_threshold_single`, ... stand for `speculative_<name>`,
    and `ngram={"match_type": ...}` for `speculative_ngram_<name>`."""
    from jaxspec.args import SpeculativeArgs
    from jaxspec.config import SpecConfig

    kw = {"speculative_" + k: v for k, v in short.items()}
    kw.update({"speculative_ngram_" + k: v for k, v in (ngram or {}).items()})
    return SpecConfig.resolve(SpeculativeArgs(speculative_algorithm=algorithm, **kw), target, bundled=bundled)


def ngram_config(**short):
    """`NgramConfig` from the `--speculative-ngram-*` flags by their short names (`match_type`,
    `max_match_window_size`, ...), validated; no flags: SGLang's defaults."""
    from jaxspec.args import SpeculativeArgs
    from jaxspec.config import NgramConfig

    return NgramConfig.from_args(SpeculativeArgs(**{"speculative_ngram_" + k: v for k, v in short.items()}))


def hf_logits(model, ids):
    """HF transformers' logits [B, T, V] of `ids` [B, T] (torch, no gradients)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def jax_logits(model, ids, chunk=None):
    """Full-sequence logits [B, T, V], optionally through chunked prefill of the KV cache."""
    import jax.numpy as jnp

    from jaxspec.cache import KVCache

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


def load_float32(path):
    """The target model at `path` (HF directory or GGUF) in float32, without its tokenizer."""
    from jaxspec.loader import load

    return load(path, "float32", progress=False, with_tokenizer=False)


def path_engine(path, **kw):
    """A plain (unless kw says otherwise) Engine over the model at `path`, 4-token prefill chunks."""
    from jaxspec.engine import Engine

    kw.setdefault("speculative_algorithm", "NONE")
    return Engine(path, skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=4, **kw)

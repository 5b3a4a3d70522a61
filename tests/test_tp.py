"""Tensor parallelism (jaxspec/sharding.py) on forced CPU host devices.

The parent pytest process has already initialised JAX with one device, so the checks run in a
child process (this file run as a script) with XLA_FLAGS=--xla_force_host_platform_device_count=4;
it writes what it observed to JSON and the tests below assert on it. Greedy tokens at tp = 2 and 4
equal tp = 1 for plain decoding, EAGLE3 and STANDALONE, offline and in the server; parameters and
KV caches are split as the rules say; the server compiles nothing new once its programs exist;
two processes joined by jax.distributed share one mesh; bad tp sizes are clear errors.
SmolLM2-135M (3 KV heads) runs at tp = 3 when it is installed.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from helpers import free_port, make_hf_model, model_dirs, save_eagle_head, serve_process, wait_ready  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
V = 16  # divisible by 2 and 4: the embedding and LM head are split too
PROMPTS = [[9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4], [5, 6, 7]]  # 3 prefill chunks of 4, and 1
GREEDY = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
KNOBS = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)


def xla_flags(devices: int) -> str:
    """The suite's own XLA_FLAGS (tests/conftest.py) and `devices` host devices."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def child(*args, devices: int = 4) -> subprocess.Popen:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(devices),
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    )  # cross-process CPU collectives (GPUs use NCCL)
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """What the child observed on tiny random models (8 heads, 4 KV heads, q/k/v bias, untied head)."""
    d = tmp_path_factory.mktemp("tp")
    tgt = make_hf_model(
        "llama",
        3,
        vocab_size=V,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        attention_bias=True,
        initializer_range=0.3,
    )
    tgt.save_pretrained(d / "target")
    make_hf_model("llama", 5, vocab_size=V, num_hidden_layers=1, initializer_range=0.3).save_pretrained(d / "small")
    save_eagle_head(
        d / "eagle3", "EAGLE3", tgt.config.to_dict(), seed=2, draft_vocab=12, scale=10.0, aux_layer_ids=[0, 1, 2]
    )
    # head_dim 16 (the kernels need a power of two >= 16): the pallas backend per device
    t16 = make_hf_model(
        "llama",
        4,
        vocab_size=V,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.3,
    )
    t16.save_pretrained(d / "target16")
    save_eagle_head(
        d / "eagle3_16", "EAGLE3", t16.config.to_dict(), seed=2, draft_vocab=12, scale=10.0, aux_layer_ids=[0, 1, 2]
    )
    return {**result(child("tiny", str(d))), "dir": str(d)}


RUNS = [("NONE", 1), ("NONE", 2), ("NONE", 4), ("EAGLE3", 2), ("EAGLE3", 4), ("STANDALONE", 2)]


@pytest.mark.parametrize("algo,tp", RUNS[1:], ids=[f"{a}-tp{t}" for a, t in RUNS[1:]])
def test_greedy_tokens_equal_tp1(tiny, algo, tp):
    assert tiny["tokens"][f"{algo}/{tp}"] == tiny["tokens"]["NONE/1"]


def test_speculation_accepts_drafts(tiny):
    for key, rounds in tiny["rounds"].items():
        assert rounds < len(PROMPTS) * GREEDY["max_new_tokens"], key  # fewer rounds than tokens


@pytest.mark.parametrize("tp", [2, 4])
def test_params_and_kv_cache_are_split(tiny, tp):
    h, hkv, d, inter = 64, 4, 8, 128
    assert tiny["shards"][str(tp)] == {
        "qkv_proj": [h, (8 + 2 * hkv) * d // tp],  # fused, shard-major: each device's own q, k and v heads
        "qkv_bias": [(8 + 2 * hkv) * d // tp],
        "o_proj": [8 * d // tp, h],
        "o_bias": [h],
        "gate_up_proj": [h, 2 * inter // tp],
        "down_proj": [inter // tp, h],
        "embed": [V // tp, h],
        "lm_head": [h, V // tp],
        "norm": [h],
        "kv_cache": [len(PROMPTS), 64, hkv // tp, d],
        "draft_qkv_proj": [2 * h, (8 + 2 * hkv) * d],
    }


def test_w8a8_int8_splits_like_float(tiny):
    """w8a8_int8 under tp = 2: the same greedy tokens as on one device, its int8 LM head split on
    the vocabulary like the float one."""
    assert tiny["w8a8"]["2"] == tiny["w8a8"]["1"]
    assert tiny["w8a8"]["head/2"] == [[64, V // 2], [V // 2]]


def test_fused_projections_add_no_communication(tiny):
    """The fused q/k/v and gate/up matmuls split on whole heads and columns: a tp = 2 prefill compiles
    to the same collectives as with separate projections."""
    assert tiny["collectives"]["fused"] == tiny["collectives"]["unfused"]
    assert tiny["collectives"]["fused"]["all-reduce"] > 0  # the check sees the partitioned program


def test_server_matches_offline_and_keeps_its_programs(tiny):
    assert tiny["server"] == tiny["tokens"]["NONE/1"]
    shape, shard = tiny["server_kv"]
    assert shard == [shape[0], shape[1], 2, 8]  # 4 KV heads / 2
    assert tiny["server_recompiles"] == 0
    assert tiny["server_shared"] == tiny["server_shared_off"] and tiny["server_shared_cached"] >= 8


def test_two_hosts(tiny):
    """Two processes x 2 devices joined by jax.distributed (what --dist-init-addr/--nnodes/--node-rank
    do) run one tp = 4 mesh; both print the tp = 1 tokens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    hosts = [child("host", addr, str(rank), tiny["dir"], devices=2) for rank in (0, 1)]
    try:
        for p in hosts:
            assert result(p)["tokens"] == tiny["tokens"]["NONE/1"]
    finally:  # a failed host leaves the other waiting for it
        for p in hosts:
            p.kill()


def test_bad_tp_sizes_are_clear_errors(tiny):
    assert "must divide the model's num_attention_heads (8)" in tiny["errors"]["3"]
    assert "tp_size must be in 1..4" in tiny["errors"]["5"]


def test_pallas_kernels_run_per_device(tiny):
    """--attention-backend pallas at tp = 2: the kernels run under shard_map on each device's heads
    (interpret mode on CPU), for the target and the replicated EAGLE-3 draft, and give the xla tokens;
    so does the decode attention mode's split verification."""
    p = tiny["pallas"]
    assert p["NONE/pallas/2"] == p["NONE/xla/1"] and p["EAGLE3/pallas/2"] == p["NONE/xla/1"]
    assert p["EAGLE3/pallas:decode/2"] == p["NONE/xla/1"]
    assert p["fallbacks"] == 0  # no shape fell back to xla


def test_cli_flags():
    from jaxspec.cli import build_parser
    from jaxspec.errors import JaxspecError
    from jaxspec.sharding import init_distributed

    a = build_parser().parse_args(
        ["generate", "--tp-size", "2", "--dist-init-addr", "10.0.0.1:5000", "--nnodes", "2", "--node-rank", "1"]
    )
    assert (a.tp_size, a.dist_init_addr, a.nnodes, a.node_rank) == (2, "10.0.0.1:5000", 2, 1)
    assert build_parser().parse_args(["serve", "--tp-size", "4"]).tp_size == 4
    with pytest.raises(JaxspecError, match="--dist-init-addr"):
        init_distributed(None, 2, 0)
    with pytest.raises(JaxspecError, match="node_rank"):
        init_distributed("127.0.0.1:5000", 2, 2)


@pytest.mark.slow
def test_serve_two_hosts(model_dirs):  # noqa: F811
    """`jaxspec serve` over two processes x 1 device (tp 2, joined by --nnodes/--node-rank/
    --dist-init-addr): node 0 serves HTTP and node 1 repeats its device calls. Greedy answers of
    8 concurrent requests, plain and speculative (STANDALONE), streamed or not, equal plain
    decoding offline on one device; SIGTERM on node 0 stops both, node 1 cleanly."""
    from jaxspec.engine import Engine

    prompts = [[1 + i, 40 + 7 * i, 300 + i, 9] * (1 + i % 3) for i in range(8)]
    greedy = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
    want = [
        o["output_ids"]
        for o in Engine(model_dirs["target"], show_progress=False).generate(input_ids=prompts, sampling_params=greedy)
    ]
    spec = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model_dirs["draft"]]
    spec += ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
    for flags in ([], spec):
        addr, port = f"127.0.0.1:{free_port() - 1}", free_port()
        common = ["--model-path", model_dirs["target"], "--context-length", "512", "--tp-size", "2", "--nnodes", "2"]
        common += ["--dist-init-addr", addr, "--disable-background-compile", *flags]
        env = dict(JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", XLA_FLAGS=xla_flags(1))
        nodes = [serve_process(["--node-rank", str(r), *common], port + r, **env) for r in (0, 1)]
        try:
            wait_ready(nodes, port, timeout=600)
            with cf.ThreadPoolExecutor(8) as pool:
                got = list(
                    pool.map(lambda i, port=port: generate(port, prompts[i], greedy, stream=i % 2 == 1), range(8))
                )
            assert got == want, flags
            nodes[0].send_signal(signal.SIGTERM)
            assert nodes[1].wait(60) == 0, nodes[1].stdout.read()[-3000:]
            nodes[0].wait(60)
            assert "node 0 stopped after" in nodes[1].stdout.read()
        finally:
            for p in nodes:
                p.kill()


def generate(port: int, ids: list[int], params: dict, stream: bool) -> list[int]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/generate", json.dumps({"input_ids": ids, "sampling_params": params, "stream": stream}))
    r = c.getresponse()
    assert r.status == 200
    if not stream:
        return json.loads(r.read())["output_ids"]
    events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    return json.loads(events[-1])["output_ids"]


@pytest.mark.slow
def test_smollm2_tp3():
    """SmolLM2-135M: 9 heads and 3 KV heads split 3 ways; 20 greedy tokens plain and with its EAGLE-3 draft."""
    from jaxspec.default_model import default_gguf_path
    from jaxspec.errors import JaxspecError

    try:
        default_gguf_path()
    except JaxspecError as e:
        pytest.skip(str(e))
    out = result(child("smollm2", devices=3))
    assert out["NONE/3"] == out["NONE/1"] and out["EAGLE3/3"] == out["NONE/1"]
    assert out["q_shard"] == [576, (9 + 2 * 3) * 64 // 3]  # fused q/k/v: 3 query + 1 + 1 KV heads each


# ---- the child process ---------------------------------------------------------------------------


def _tiny_checks(d: str) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxspec.cache import KVCache
    from jaxspec.decode import prefill_chunk
    from jaxspec.engine import Engine
    from jaxspec.errors import JaxspecError
    from jaxspec.sampling import SamplingParams
    from jaxspec.server.scheduler import Request, Scheduler

    drafts = {
        "NONE": {},
        "EAGLE3": dict(speculative_draft_model_path=f"{d}/eagle3", **KNOBS),
        "STANDALONE": dict(speculative_draft_model_path=f"{d}/small", **KNOBS),
    }

    def engine(algo, tp, **kw):
        return Engine(
            f"{d}/target",
            skip_tokenizer_init=True,
            show_progress=False,
            chunked_prefill_size=4,
            tp_size=tp,
            speculative_algorithm=algo,
            **drafts[algo],
            **kw,
        )

    res = {"tokens": {}, "rounds": {}, "shards": {}, "errors": {}}
    for algo, tp in RUNS:
        eng = engine(algo, tp)
        out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        res["tokens"][f"{algo}/{tp}"] = [o["output_ids"] for o in out]
        if algo != "NONE":
            res["rounds"][f"{algo}/{tp}"] = sum(o["meta_info"]["spec_verify_ct"] for o in out)
        if algo == "EAGLE3":
            shard = lambda x: list(x.sharding.shard_shape(x.shape))
            p, layer = eng.params, eng.params["layers"][0]
            cache = KVCache.create(eng.cfg, len(PROMPTS), 64, eng.dtype, eng.kv_sharding)
            cache, _ = prefill_chunk(
                eng.models,
                cache,
                jnp.asarray([(x + [0] * 4)[:4] for x in PROMPTS]),
                jnp.int32(0),
                jnp.asarray([4, 3]),
                jnp.zeros((len(PROMPTS), eng.cfg.hidden_size)),
            )
            a, m = layer["self_attn"], layer["mlp"]
            res["shards"][str(tp)] = {
                "qkv_proj": shard(a["qkv_proj"]["kernel"][...]),
                "qkv_bias": shard(a["qkv_proj"]["bias"][...]),
                "o_proj": shard(a["o_proj"]["kernel"][...]),
                "o_bias": shard(a["o_proj"]["bias"][...]),
                "gate_up_proj": shard(m["gate_up_proj"]["kernel"][...]),
                "down_proj": shard(m["down_proj"]["kernel"][...]),
                "embed": shard(p["embed_tokens"][...]),
                "lm_head": shard(p["lm_head"]["kernel"][...]),
                "norm": shard(layer["input_layernorm"]["weight"][...]),
                "kv_cache": shard(cache.k[0]),  # after a jitted prefill: still split on KV heads
                "draft_qkv_proj": shard(
                    eng.dparams["draft"]["midlayer"]["self_attn"]["qkv_proj"]["kernel"][...]
                ),  # replicated
            }

    res["w8a8"] = {}
    for tp in (1, 2):  # integer matmuls split over devices: the int32 partial sums add up exactly
        eng = engine("NONE", tp, quantization="w8a8_int8")
        res["w8a8"][str(tp)] = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        head = eng.params["head_int8"]
        res["w8a8"][f"head/{tp}"] = [
            list(x.sharding.shard_shape(x.shape)) for x in (head["kernel"][...], head["scale"][...])
        ]

    res["collectives"] = {}
    for fuse in (True, False):
        eng = engine("NONE", 2, _fuse=fuse)
        cache = KVCache.create(eng.cfg, 2, 64, eng.dtype, eng.kv_sharding)
        hlo = (
            prefill_chunk.lower(
                eng.models,
                cache,
                jnp.zeros((2, 4), jnp.int32),
                jnp.int32(0),
                jnp.asarray([4, 3]),
                jnp.zeros((2, eng.cfg.hidden_size)),
            )
            .compile()
            .as_text()
        )
        ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
        res["collectives"]["fused" if fuse else "unfused"] = {op: hlo.count(f" {op}(") for op in ops}

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )

    def serve(sched, prompts=PROMPTS):
        got = {}
        for i, ids in enumerate(prompts):
            sched.submit(
                Request(
                    ids=ids,
                    params=SamplingParams.from_dict(GREEDY),
                    emit=lambda e, i=i: got.__setitem__(i, e["result"]["output_ids"]) if e["type"] == "done" else None,
                )
            )
        sched.run_until_idle()
        return [got[i] for i in range(len(prompts))]

    sched = Scheduler(engine("EAGLE3", 2), max_running_requests=2)
    serve(sched)
    n = len(compiles)
    res["server"] = serve(sched)  # the same requests again: every program exists already
    res["server_recompiles"] = len(compiles) - n
    k = sched.batch.core.cache.k[0]
    res["server_kv"] = [list(k.shape), list(k.sharding.shard_shape(k.shape))]
    # prefix caching under tensor parallelism: a prefix copied from another slot (split KV buffers)
    shared = [PROMPTS[0] + [1, 2], PROMPTS[0][:9] + [3, 3]]
    before = sched.stats.cached_tokens
    res["server_shared"] = serve(sched, shared)
    res["server_shared_cached"] = sched.stats.cached_tokens - before
    res["server_shared_off"] = serve(Scheduler(engine("EAGLE3", 2), max_running_requests=2, prefix_cache=False), shared)

    from jaxspec import attention

    res["pallas"] = {}
    for algo, backend, tp in [
        ("NONE", "xla", 1),
        ("NONE", "pallas", 2),
        ("EAGLE3", "pallas", 2),
        ("EAGLE3", "pallas:decode", 2),
    ]:
        backend, _, mode = backend.partition(":")
        eng = Engine(
            f"{d}/target16",
            skip_tokenizer_init=True,
            show_progress=False,
            chunked_prefill_size=4,
            tp_size=tp,
            attention_backend=backend,
            speculative_algorithm=algo,
            **(dict(speculative_draft_model_path=f"{d}/eagle3_16", **KNOBS) if algo == "EAGLE3" else {}),
            **(dict(speculative_attention_mode=mode) if mode else {}),
        )
        assert eng.backend == backend
        res["pallas"][f"{algo}/{backend}{':' + mode if mode else ''}/{tp}"] = [
            o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        ]
    res["pallas"]["fallbacks"] = attention._warn_fallback.cache_info().currsize
    for tp in (3, 5):
        try:
            engine("NONE", tp)
        except JaxspecError as e:
            res["errors"][str(tp)] = str(e)
    return res


def _smollm2_checks() -> dict:
    from jaxspec.engine import Engine
    from jaxspec.loader import load

    loaded = load(None, progress=False)
    res = {}
    for algo, tp in [("NONE", 1), ("NONE", 3), ("EAGLE3", 3)]:
        eng = Engine(
            _loaded=loaded,
            tp_size=tp,
            speculative_algorithm=algo,
            show_progress=False,
            chunked_prefill_size=64,
            context_length=128,
        )
        res[f"{algo}/{tp}"] = eng.generate(
            "The capital of France is", {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
        )["output_ids"]
        if tp == 3:
            q = eng.params["layers"][0]["self_attn"]["qkv_proj"]["kernel"][...]
            res["q_shard"] = list(q.sharding.shard_shape(q.shape))
    return res


def _host(addr: str, rank: int, d: str) -> dict:
    from jaxspec.engine import Engine
    from jaxspec.sharding import init_distributed

    init_distributed(addr, 2, rank)
    eng = Engine(f"{d}/target", skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=4, tp_size=4)
    return {"tokens": [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]}


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(HERE)]
    mode, args = sys.argv[1], sys.argv[2:]
    checks = {
        "tiny": lambda: _tiny_checks(*args),
        "host": lambda: _host(args[0], int(args[1]), args[2]),
        "smollm2": _smollm2_checks,
    }
    print(json.dumps(checks[mode]()))

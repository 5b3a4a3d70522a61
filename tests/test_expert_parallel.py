"""Expert parallelism (`ep_size`, jaxspec/sharding.py and jaxspec/models/moe.py) on forced CPU host
devices, for a tiny random Qwen3-MoE model (8 experts, top 2; layer 0 dense, layers 1 and 2 sparse).

As in tests/test_tp.py, the parent pytest process has one device, so the checks that need several run
in one child process (this file run as a script) with XLA_FLAGS=--xla_force_host_platform_device_count=4;
it prints what it observed as JSON and the tests below assert on it. Greedy tokens at (tp, ep) =
(2, 2), (4, 2) and (4, 4), plain, with NGRAM and with EAGLE-3, offline and through the server's
scheduler, equal one device's; the experts' stacked weights are split as the rules say; the MoE
blocks add one all-reduce each to the compiled program; the sharded block equals the one-device one.
Flag errors that need no devices are checked in the parent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from helpers import make_hf_model, save_eagle_head

HERE = os.path.dirname(os.path.abspath(__file__))
V = 64
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 3, 4]]
GREEDY = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
EAGLE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
# (algorithm, tp, ep, prefill chunk): a chunk of 16 rows x 2 prompts x top 2 takes the ragged_dot path,
# 4-row chunks and decode steps the gathered one (models/moe.py)
RUNS = [
    ("NONE", 1, 1, 4),
    ("NONE", 2, 2, 16),
    ("NONE", 4, 4, 4),
    ("NGRAM", 2, 2, 4),
    ("EAGLE3", 4, 2, 4),
    ("EAGLE3", 4, 4, 4),
]


def child(*args, devices: int = 4) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (4 heads, 4 KV heads: tp up to 4) and a random EAGLE-3 head for it."""
    d = tmp_path_factory.mktemp("ep")
    hf = make_hf_model("qwen3_moe", 0, vocab_size=V, num_key_value_heads=4, num_hidden_layers=3, initializer_range=0.3)
    hf.save_pretrained(d / "target")
    save_eagle_head(d / "eagle3", "EAGLE3", hf.config.to_dict(), seed=2, scale=10.0, aux_layer_ids=[0, 1, 2])
    return str(d)


@pytest.fixture(scope="module")
def seen(moe_dir) -> dict:
    """make test's checks (one child process): RUNS[:2] (one device, then tp = ep = 2), the
    collectives, the errors."""
    return child("checks", moe_dir, "quick")


@pytest.fixture(scope="module")
def seen_full(moe_dir) -> dict:
    """Every check: all of RUNS, the sharded block, the server's scheduler (the slow tests)."""
    return child("checks", moe_dir, "full")


@pytest.mark.parametrize(
    "run",
    [pytest.param(r, marks=() if r == RUNS[1] else pytest.mark.slow) for r in RUNS[1:]],
    ids=[f"{a}-tp{t}-ep{e}" for a, t, e, _ in RUNS[1:]],
)
def test_greedy_tokens_equal_one_device(request, run):
    algo, tp, ep, _ = run
    seen = request.getfixturevalue("seen" if run == RUNS[1] else "seen_full")
    assert seen["tokens"][f"{algo}/{tp}/{ep}"] == seen["tokens"]["NONE/1/1"]


@pytest.mark.slow
def test_speculation_accepts_drafts(seen_full):
    seen = seen_full
    assert seen["rounds"]
    for key, rounds in seen["rounds"].items():
        assert rounds < len(PROMPTS) * GREEDY["max_new_tokens"], key  # fewer rounds than tokens


@pytest.mark.parametrize("which", ["seen", pytest.param("seen_full", marks=pytest.mark.slow)])
def test_experts_are_split(request, which):
    """gate_up_proj [E, H, 2I] = [8, 64, 64] and down_proj [E, I, H] = [8, 32, 64]: E split ep ways, and
    I split within a group when ep < tp; the router stays whole; attention is split tp ways as ever."""
    seen = request.getfixturevalue(which)
    e, h, i = 8, 64, 32
    want = {
        "2/2": ([e // 2, h, 2 * i], [e // 2, i, h]),
        "4/4": ([e // 4, h, 2 * i], [e // 4, i, h]),
        "4/2": ([e // 2, h, 2 * i // 2], [e // 2, i // 2, h]),
    }
    if which == "seen":  # make test's child ran (tp, ep) = (2, 2) alone
        want = {"2/2": want["2/2"]}
    for key, (gate_up, down) in want.items():
        got = seen["shards"][key]
        assert (got["gate_up_proj"], got["down_proj"]) == (gate_up, down), key
        assert got["router"] == [e, h], key
        tp = int(key.split("/")[0])
        assert got["qkv_proj"] == [h, (4 + 2 * 4) * 32 // tp], key
        assert got["kv_cache"][2] == 4 // tp, key
    if which == "seen_full":
        assert seen["specs"]["4/2"] == ["ep", None, "moe_tp"]


def test_moe_blocks_add_an_all_reduce_each(seen):
    """A tp = 2 prefill: with ep = 2 the two sparse layers each all-reduce the experts' shares; with
    ep = 1 (experts replicated) they communicate nothing."""
    c = seen["collectives"]
    assert c["2/2"]["all-reduce"] == c["2/1"]["all-reduce"] + 2, c
    assert c["2/2"]["all-to-all"] == 0


@pytest.mark.slow
def test_sharded_block_equals_one_device(seen_full):
    """experts_parallel at (tp, ep) = (4, 2) against experts_ragged on one device, relative error."""
    assert seen_full["block_err"]
    for rows, err in seen_full["block_err"].items():
        assert err < 1e-5, rows


@pytest.mark.slow
def test_server_matches_offline_and_keeps_its_programs(seen_full):
    assert seen_full["server"] == seen_full["tokens"]["NONE/1/1"]
    assert seen_full["server_recompiles"] == 0


def test_bad_ep_sizes_are_clear_errors(seen, moe_dir):
    from jaxspec.config import ModelConfig
    from jaxspec.engine import Engine
    from jaxspec.errors import JaxspecError
    from jaxspec.sharding import check_heads

    with pytest.raises(JaxspecError, match="ep_size must be >= 1, got 0"):
        Engine(f"{moe_dir}/target", ep_size=0, show_progress=False)
    with pytest.raises(JaxspecError, match="ep_size 2 must divide tp_size 1"):
        Engine(f"{moe_dir}/target", ep_size=2, show_progress=False)
    with open(f"{moe_dir}/target/config.json") as f:
        cfg = ModelConfig.from_hf(json.load(f))
    with pytest.raises(JaxspecError, match=r"must divide the model's num_experts \(6\)"):
        check_heads(dataclasses.replace(cfg, num_experts=6), 4, 4)
    assert "ep_size 3 must divide tp_size 4" in seen["errors"]["4/3"]
    assert "needs a mixture-of-experts model" in seen["errors"]["dense"]


def test_param_specs_and_flag():
    from jax.sharding import PartitionSpec as P

    from jaxspec.cli import build_parser
    from jaxspec.sharding import param_spec

    up, down = ("layers", 1, "mlp", "experts", "gate_up_proj"), ("layers", 1, "mlp", "experts", "down_proj")
    assert param_spec(up, (8, 64, 64), 4, 1) == P()  # tensor parallelism alone replicates the experts
    assert param_spec(up, (8, 64, 64), 4, 4) == P("ep", None, None)
    assert param_spec(up, (8, 64, 64), 4, 2) == P("ep", None, "moe_tp")
    assert param_spec(down, (8, 32, 64), 4, 2) == P("ep", "moe_tp", None)
    assert param_spec(down, (8, 30, 64), 8, 2) == P("ep", None, None)  # 4 does not divide I = 30: whole
    qkv = ("layers", 0, "self_attn", "qkv_proj", "kernel")
    assert param_spec(qkv, (64, 384), 4, 2) == P(None, ("ep", "moe_tp"))  # all 4 devices, as at ep 1
    assert param_spec(qkv, (64, 384), 4, 4) == P(None, "ep")
    assert param_spec(("layers", 1, "mlp", "gate", "weight"), (8, 64), 4, 2) == P()
    for command in ("generate", "serve", "bench"):
        assert build_parser().parse_args([command, "--tp-size", "4", "--ep-size", "2"]).ep_size == 2


# ---- the child process ---------------------------------------------------------------------------


def _checks(d: str, full: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.cache import KVCache
    from jaxspec.decode import prefill_chunk
    from jaxspec.engine import Engine
    from jaxspec.errors import JaxspecError
    from jaxspec.models import moe
    from jaxspec.sampling import SamplingParams
    from jaxspec.server.scheduler import Request, Scheduler

    def engine(algo, tp, ep, chunk=4, path=f"{d}/target"):
        spec = dict(speculative_draft_model_path=f"{d}/eagle3", **EAGLE) if algo == "EAGLE3" else {}
        return Engine(
            path,
            skip_tokenizer_init=True,
            show_progress=False,
            chunked_prefill_size=chunk,
            tp_size=tp,
            ep_size=ep,
            speculative_algorithm=algo,
            **spec,
        )

    shard = lambda x: list(x.sharding.shard_shape(x.shape))
    res: dict = {"tokens": {}, "rounds": {}, "shards": {}, "specs": {}, "errors": {}, "collectives": {}}
    engines = {}
    for algo, tp, ep, chunk in RUNS if full else RUNS[:2]:
        eng = engines[(tp, ep)] = engine(algo, tp, ep, chunk)
        out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        res["tokens"][f"{algo}/{tp}/{ep}"] = [o["output_ids"] for o in out]
        if algo != "NONE":
            res["rounds"][f"{algo}/{tp}/{ep}"] = sum(o["meta_info"]["spec_verify_ct"] for o in out)
        if ep > 1:
            layer = eng.params["layers"][1]
            gu = layer["mlp"]["experts"]["gate_up_proj"][...]
            cache = KVCache.create(eng.cfg, len(PROMPTS), 32, eng.dtype, eng.kv_sharding)
            res["shards"][f"{tp}/{ep}"] = {
                "gate_up_proj": shard(gu),
                "down_proj": shard(layer["mlp"]["experts"]["down_proj"][...]),
                "router": shard(layer["mlp"]["gate"]["weight"][...]),
                "qkv_proj": shard(layer["self_attn"]["qkv_proj"]["kernel"][...]),
                "kv_cache": shard(cache.k[0]),
            }
            res["specs"][f"{tp}/{ep}"] = list(gu.sharding.spec)

    # the compiled prefill's collectives, with and without expert parallelism
    for tp, ep in ((2, 1), (2, 2)):
        eng = engines.get((tp, ep)) or engine("NONE", tp, ep)
        cache = KVCache.create(eng.cfg, 2, 32, eng.dtype, eng.kv_sharding)
        args = (jnp.zeros((2, 4), jnp.int32), jnp.int32(0), jnp.asarray([4, 3]), jnp.zeros((2, eng.cfg.hidden_size)))
        hlo = prefill_chunk.lower(eng.models, cache, *args).compile().as_text()
        res["collectives"][f"{tp}/{ep}"] = {op: hlo.count(f" {op}(") for op in ("all-reduce", "all-to-all")}

    make_hf_model("llama", 0, vocab_size=V, num_key_value_heads=4).save_pretrained(f"{d}/dense")
    for key, tp, ep, path in (("4/3", 4, 3, f"{d}/target"), ("dense", 2, 2, f"{d}/dense")):
        try:
            engine("NONE", tp, ep, path=path)
        except JaxspecError as e:
            res["errors"][key] = str(e)
    if not full:
        return res

    # the sharded block against the one-device one on the same weights (4/2: experts and I split)
    eng = engines[(4, 2)]
    block = eng.params["layers"][1]["mlp"]
    gate_up, down = block["experts"]["gate_up_proj"][...], block["experts"]["down_proj"][...]
    natural = np.asarray(moe._regroup(gate_up, 2, 2, None))  # [gate | up] again
    rng = np.random.default_rng(0)
    res["block_err"] = {}
    for rows in (3, 37):  # gathered, ragged
        x = jnp.asarray(rng.standard_normal((rows, eng.cfg.hidden_size)), jnp.float32)
        w, ids = moe.route(x, np.asarray(block["gate"]["weight"][...]), 2, True)
        got = jax.jit(lambda *a: moe.experts_parallel(eng.mesh, *a, 2))(x, w, ids, gate_up, down)
        want = moe.experts_ragged(x, w, ids, jnp.asarray(natural), jnp.asarray(np.asarray(down)))
        res["block_err"][str(rows)] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))

    # the server's scheduler over the (4, 2) engine: its tokens, and nothing compiled the second time
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )

    def serve(sched):
        got = {}
        for i, ids in enumerate(PROMPTS):
            emit = lambda e, i=i: got.__setitem__(i, e["result"]["output_ids"]) if e["type"] == "done" else None
            sched.submit(Request(ids=ids, params=SamplingParams.from_dict(GREEDY), emit=emit))
        sched.run_until_idle()
        return [got[i] for i in range(len(PROMPTS))]

    sched = Scheduler(engine("NONE", 4, 2), max_running_requests=2)
    serve(sched)
    n = len(compiles)
    res["server"] = serve(sched)
    res["server_recompiles"] = len(compiles) - n
    return res


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(HERE), HERE]
    print(json.dumps(_checks(sys.argv[2], sys.argv[3] == "full")))

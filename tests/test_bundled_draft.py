"""The draft shipped for the default model: chosen by default, turned off by NONE, lossless."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import jaxspec.drafts as drafts
from jaxspec.config import ModelConfig
from jaxspec.errors import JaxspecError

from helpers import resolve_spec

SMOL = ModelConfig(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=1e5,
)


def test_shipped_draft_is_present_and_small():
    found = drafts.bundled_drafts()
    assert found, "no draft is shipped in jaxspec/drafts"
    for path, meta in found.items():
        size = sum(f.stat().st_size for f in __import__("pathlib").Path(path).iterdir())
        assert size <= 32 * 2**20, f"{path} is {size / 2**20:.1f} MiB"
        cfg = json.load(open(f"{path}/config.json"))
        assert cfg["architectures"] == [
            {"EAGLE3": "LlamaForCausalLMEagle3", "EAGLE": "LlamaForCausalLMEagle"}[meta["algorithm"]]
        ]
    defaults = [m["algorithm"] for m in found.values() if m.get("default")]
    assert defaults == ["EAGLE3"], "exactly one default draft (the EAGLE-3 head) per target"


def test_matching_rule(tmp_path, monkeypatch):
    d = tmp_path / "smol-head"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    meta = {
        "target": "SmolLM2-135M-Instruct",
        "algorithm": "EAGLE3",
        "default": True,
        "shape": {"hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "vocab_size": 49152},
    }
    (d / "target.json").write_text(json.dumps(meta))
    e2 = tmp_path / "smol-eagle2"  # a second, non-default head of another algorithm
    e2.mkdir()
    (e2 / "model.safetensors").write_bytes(b"")
    (e2 / "target.json").write_text(json.dumps({**meta, "algorithm": "EAGLE", "default": False}))
    monkeypatch.setattr(drafts, "HERE", str(tmp_path))
    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct-Q4_1", SMOL) == ("EAGLE3", str(d), None)
    assert drafts.bundled_draft_for("/x/smollm2-135m-instruct/", SMOL) == ("EAGLE3", str(d), None)
    assert drafts.bundled_draft_for("/x/other-model", SMOL) is None
    import dataclasses

    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", dataclasses.replace(SMOL, num_layers=12)) is None
    assert drafts.bundled_draft_for(None, SMOL) is None
    # an algorithm picks the head of that kind; unset picks the default one
    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", SMOL, "EAGLE") == ("EAGLE", str(e2), None)
    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", SMOL, "EAGLE3") == ("EAGLE3", str(d), None)
    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", SMOL, "STANDALONE") is None
    # tree shapes are per platform; a platform without one keeps the auto defaults
    tree = {
        "cpu": {"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 5, "sampled_eagle_topk": 1},
        "gpu": {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8},
    }
    (d / "target.json").write_text(json.dumps({**meta, "tree": tree}))
    cpu = drafts.ShippedTree(3, 2, 5, sampled_eagle_topk=1)
    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", SMOL, platform="cpu") == ("EAGLE3", str(d), cpu)
    gpu = drafts.ShippedTree(5, 4, 8)
    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", SMOL, platform="gpu") == ("EAGLE3", str(d), gpu)
    (d / "target.json").write_text(json.dumps({**meta, "tree": {"gpu": tree["gpu"]}}))
    assert drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", SMOL, platform="cpu") == ("EAGLE3", str(d), None)


def test_resolution_with_a_shipped_draft():
    b = ("EAGLE3", "/drafts/smol", None)
    s = resolve_spec(None, SMOL, bundled=b)
    assert (
        s.algorithm == "EAGLE3"
        and s.draft_model_path == "/drafts/smol"
        and (s.num_steps, s.eagle_topk, s.num_draft_tokens) == (5, 4, 8)
    )
    assert not resolve_spec("NONE", SMOL, bundled=b).enabled
    assert resolve_spec("eagle3", SMOL, bundled=b).draft_model_path == "/drafts/smol"
    assert resolve_spec("EAGLE3", SMOL, draft_model_path="/mine", bundled=b).draft_model_path == "/mine"
    with pytest.raises(JaxspecError, match="needs speculative_draft_model_path"):
        resolve_spec("EAGLE", SMOL, bundled=b)  # a different algorithm needs its own draft
    assert not resolve_spec(None, SMOL).enabled  # nothing shipped: plain decoding
    tuned = ("EAGLE3", "/drafts/smol", (3, 1, 4))  # the shape measured best for the shipped draft
    s = resolve_spec(None, SMOL, bundled=tuned)
    assert (s.num_steps, s.eagle_topk, s.num_draft_tokens) == (3, 1, 4)
    s = resolve_spec(None, SMOL, bundled=tuned, num_steps=6, eagle_topk=2, num_draft_tokens=10)
    assert (s.num_steps, s.eagle_topk, s.num_draft_tokens) == (6, 2, 10)
    s = resolve_spec("EAGLE3", SMOL, draft_model_path="/mine", bundled=tuned)  # own draft: SGLang's auto defaults
    assert (s.num_steps, s.eagle_topk, s.num_draft_tokens) == (5, 4, 8)


def test_a_shipped_shape_for_rounds_that_sample():
    """A shipped tree may name another top-k for rounds that sample: the greedy shape keeps the
    tree, sampling rounds with drawn drafts run the chain, and a shape the user set is run as set."""
    shipped = ("EAGLE3", "/drafts/smol", drafts.ShippedTree(2, 2, 4, sampled_eagle_topk=1))
    s = resolve_spec(None, SMOL, bundled=shipped)
    shape = lambda x: (x.num_steps, x.eagle_topk, x.num_draft_tokens)
    assert shape(s) == (2, 2, 4) and s.sampled_topk == 1
    assert s.for_kind(False) is s
    chain = s.for_kind(True)
    assert shape(chain) == (2, 1, 3) and chain.sampled_topk is None and chain.for_kind(True) is chain
    assert chain.scratch_tokens < s.scratch_tokens  # the KV scratch sized for the configured shape holds it
    assert dataclasses.replace(s, draft_sampling=False).for_kind(True).eagle_topk == 2  # target-only: siblings pay
    set_by_user = resolve_spec(None, SMOL, bundled=shipped, num_steps=2, eagle_topk=2, num_draft_tokens=4)
    assert set_by_user.sampled_topk is None and set_by_user.for_kind(True) is set_by_user
    wider = drafts.ShippedTree(4, 2, 6, sampled_eagle_topk=1)  # the chain's N follows its depth
    assert shape(resolve_spec(None, SMOL, bundled=("EAGLE3", "/d", wider)).for_kind(True)) == (4, 1, 5)
    # the shipped head's own file: the CPU shape is a tree for greedy rounds and a chain for sampling ones
    found = drafts.bundled_draft_for("/x/SmolLM2-135M-Instruct", SMOL, platform="cpu")
    assert found is not None and found[2] == drafts.ShippedTree(2, 2, 4, sampled_eagle_topk=1)


@pytest.mark.slow
def test_float32_engine_speculates_with_the_shipped_draft_losslessly(default_engine):
    """The default model read as float32 (the default off the CPU) speculates with its shipped EAGLE-3
    head by itself, token-identical to float32 plain decoding."""
    import jaxspec

    eng = jaxspec.Engine(show_progress=False, dtype="float32")
    assert eng.speculative_algorithm == "EAGLE3" and eng.spec.draft_model_path.startswith(drafts.HERE)
    assert default_engine.speculative_algorithm == "NONE"
    msgs = [
        [{"role": "user", "content": p}]
        for p in ("What is the capital of France?", "List three colours.", "Explain gravity.")
    ]
    sp = {"temperature": 0, "max_new_tokens": 48}
    got = eng.chat(msgs, sp)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in default_engine.chat(msgs, sp)]
    # a trained head accepts well beyond the single bonus token an untrained one gives
    assert np.mean([r["meta_info"]["spec_accept_length"] for r in got]) > 2.0
    if jax.default_backend() == "cpu":
        # greedy rounds run the shipped CPU tree (or adaptive speculation's other candidates),
        # sampling rounds the chain of the same depth (SpecConfig.for_kind)
        assert set(got[0]["meta_info"]["spec_shapes"]) == {"2/2/4", "1/2/3", "off"}
        hot = eng.chat(msgs[:1], {"temperature": 1, "max_new_tokens": 48, "seed": 1})[0]["meta_info"]
        assert set(hot["spec_shapes"]) == {"2/1/3", "1/1/2", "off"} and hot["spec_verify_ct"] > 0
        # the server's CPU programs sample (they serve greedy calls too): one shape, the chain
        from jaxspec.server.scheduler import Scheduler

        sched = Scheduler(eng, max_running_requests=1)
        assert sched.main_shape == "2/1/3" and list(sched.shapes) == ["2/1/3", "1/1/2", "off"]
    # "EAGLE" without a draft path: the shipped EAGLE-2 head, lossless too
    e2 = jaxspec.Engine(show_progress=False, dtype="float32", speculative_algorithm="EAGLE")
    assert e2.spec.draft_model_path.endswith("smollm2-135m-instruct-eagle2")
    got2 = e2.chat(msgs, sp)
    assert [r["output_ids"] for r in got2] == [r["output_ids"] for r in got]
    assert np.mean([r["meta_info"]["spec_accept_length"] for r in got2]) > 1.5
    # penalties are not speculative yet: with the shipped draft chosen for the user, such a batch
    # falls back to plain decoding (an explicit speculative_algorithm still gets the error)
    pen = dict(sp, repetition_penalty=1.3, max_new_tokens=16)
    assert eng.chat(msgs[:1], pen)[0]["output_ids"] == default_engine.chat(msgs[:1], pen)[0]["output_ids"]

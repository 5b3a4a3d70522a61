"""The GPU draft-training job (`benchmarks/gpu/smollm2_drafts.sh train`) at toy size on the CPU: the
same script and flags, a tiny random target with SmolLM2's tokenizer, a budget of seconds. It must
end within its budget, choose the draft vocabulary by coverage, send back a head that loads and stays
lossless, and continue from that head on a later run (stages 4 and 5) without answering prompts again."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import make_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu", "smollm2_drafts.sh")
BUDGET = 60


def _job(*args, env):
    return subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=BUDGET + 240)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A machine directory ($W) with a tiny target, prompts and originals, as `stage 1-3` leave it."""
    from jaxspec.default_model import default_model_path

    w = tmp_path_factory.mktemp("w")
    model = w / "SmolLM2-135M-Instruct"
    hf = make_hf_model("llama", 3, vocab_size=49152, num_hidden_layers=8, max_position_embeddings=1024)
    hf.save_pretrained(model)
    src = default_model_path(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), model / name)
    rng = np.random.default_rng(0)
    words = "the a cat dog runs over hill why how code list write poem about sea sun".split()
    with open(w / "prompts.jsonl", "w") as f:
        for _ in range(24):
            q = " ".join(rng.choice(words, 8)) + "?"
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "-"}]}))
            f.write("\n")
    with gzip.open(w / "originals.jsonl.gz", "wt") as f:
        for _ in range(8):
            q, a = " ".join(rng.choice(words, 6)), " ".join(rng.choice(words, 30))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
            f.write("\n")
    env = {
        **os.environ,
        "W": str(w),
        "PY": sys.executable,
        "PYTHONPATH": REPO,
        "JAX_PLATFORMS": "cpu",
        "BUDGET": str(BUDGET),
        "SYNTH": "9",
        "BATCH": "8",
        "NEW": "12",
        "LEN": "128",
        "MIX": "8",
        "EVAL": "4",
        "BS": "4",
        "TTT": "2",
    }
    return w, env


@pytest.mark.slow  # about 2 minutes; run it before a GPU slice is spent on the job
def test_the_gpu_training_job_runs_at_toy_size_and_continues(toy, tmp_path):
    w, env = toy
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = _job("train", env={**env, "OUT": str(out)})
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and all(os.path.getsize(out / f) <= 16 * 2**20 for f in files)  # what comes back
    head = tmp_path / "head"
    r = _job("unpack", str(out), str(head), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    ev = json.loads((head / "eval.json").read_text())
    # the budget holds: train-draft's own phases, and the whole command with its start-up and packing
    assert sum(ev["wall_s"].values()) <= BUDGET and took <= BUDGET + 90, (ev["wall_s"], took)
    assert ev["steps"] > 0 and ev["held_out_after"] is not None
    assert ev["draft_vocab_size"] == 8192  # the least it may choose: a tiny random target's answers are narrow
    assert 0.97 <= ev["draft_vocab_coverage_of_answers"] <= 1.0
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 8192 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    data = [json.loads(line) for line in open(head / "train_data.jsonl")]
    assert {d.get("category") for d in data if d.get("messages")} >= {"chat"}
    # the target was asked for prompts of the categories in turn (a random one writes few usable ones)
    from jaxspec.train.synth import CATEGORIES

    tried = list(dict.fromkeys(json.loads(line)["category"] for line in open(head / "synth_prompts.jsonl")))
    assert tried and tried == list(CATEGORIES)[: len(tried)]  # (how many: as the deadline allowed)

    # the head loads like any other and stays lossless
    from jaxspec.engine import Engine

    plain = Engine(str(w / "SmolLM2-135M-Instruct"), show_progress=False, speculative_algorithm="NONE")
    spec = Engine(
        str(w / "SmolLM2-135M-Instruct"),
        show_progress=False,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(head),
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
    )
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    assert [o["output_ids"] for o in spec.generate(input_ids=ids, sampling_params=sp)] == [
        o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=sp)
    ]

    # the next slice: carry the head and its answers back (.gpu4, .gpu5), stage them, train again from them
    pieces = [os.path.join(REPO, f".gpu{n}") for n in (4, 5)]
    assert not any(map(os.path.exists, pieces)), "a real .gpu4 or .gpu5 is in the way"
    try:
        assert _job("carry", str(head), env=env).returncode == 0
        assert _job("stage", "4", env=env).returncode == 0 and _job("stage", "5", env=env).returncode == 0
    finally:
        for p in pieces:
            shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(w / "head-t")
    r = _job("train", env={**env, "OUT": str(tmp_path / "out2"), "BUDGET": "30"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"--init-head {w}/prev" in r.stdout + r.stderr
    again = tmp_path / "again"
    assert _job("unpack", str(tmp_path / "out2"), str(again), env=env).returncode == 0
    ev2 = json.loads((again / "eval.json").read_text())
    # it started from the first head (held-out loss no worse than an untrained head's) and kept its vocabulary
    assert ev2["held_out_before"] is not None and ev2["held_out_before"]["loss"] <= ev["held_out_after"]["loss"] * 1.05
    assert json.loads((again / "config.json").read_text())["draft_vocab_size"] == 8192
    # the answers came with it: the ShareGPT-style prompts were not answered a second time
    assert len([line for line in open(again / "train_data.jsonl")]) >= len(data)

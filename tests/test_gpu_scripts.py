"""The GPU round/graphs/HF job (`benchmarks/gpu/round_job.sh`) at toy size on the CPU, so that a GPU
slice is never spent on a script that does not run: part 1, the round bisect over a packed past
version and the working tree under three XLA flag sets, with launch counts from a trace; part 2,
bench_plain.py's jaxspec against HF transformers on the random weights with SmolLM2's tokenizer.
The round programs' HLO is dumped and profiled, and the timed passes must compile nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "benchmarks", "gpu", "round_job.sh")
BISECT = os.path.join(REPO, "benchmarks", "gpu", "round_bisect.py")


@pytest.mark.slow  # about 5 minutes
def test_round_job_runs_at_toy_size(tmp_path):
    from jaxspec.bench import mtbench_questions
    from jaxspec.default_model import default_model_path

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "PY": sys.executable, "SIZE": "toy"}
    gpu6 = tmp_path / "gpu6"  # what `round_job.sh prepare` carries, smaller: one past version
    (gpu6 / "tokenizer").mkdir(parents=True)
    src = default_model_path(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), gpu6 / "tokenizer")
    with open(gpu6 / "question.jsonl", "w") as f:
        for i, turns in enumerate(mtbench_questions()[:4]):
            f.write(json.dumps({"question_id": i, "category": "writing", "turns": turns}) + "\n")
    # the version of the 2026-11-22 H100 run; left out where the clone has no history
    packed = subprocess.run(
        [sys.executable, BISECT, "pack", "--out", str(gpu6 / "variants"), "e77d0b2"], capture_output=True, text=True
    )
    has_history = packed.returncode == 0
    (gpu6 / "variants").mkdir(exist_ok=True)
    env |= {"W": str(tmp_path / "w"), "OUT": str(tmp_path / "out"), "GPU6": str(gpu6)}

    env1 = {**env, "BISECT_ARGS": "--tokens 8 --prompts 1 --repeats 1"}
    r = subprocess.run(["bash", JOB, "1"], env=env1, capture_output=True, text=True, timeout=900)
    rows = json.loads((tmp_path / "out" / "round_bisect.json").read_text())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    versions = ["HEAD"] + (["e77d0b2"] if has_history else [])
    graphs = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"
    flags = ("", "--xla_gpu_enable_command_buffer=", graphs)
    assert [(row["variant"], row["xla_flags"]) for row in rows] == [(v, f) for f in flags for v in versions]
    for row in rows:
        assert "error" not in row, row.get("error")
        for k in ("plain_T0", "plain_T1", "eagle3_T0", "eagle3_T1"):
            assert row[k]["ms_per_round"] > 0 and row[k]["tokens"] == 8
        assert row["plain_T0"]["accept"] == 1.0 and row["plain_trace"]["rounds"] == 8
        assert "kernel_launch_calls" in row["eagle3_trace"] and "gpu_events" in row["eagle3_trace"]
        assert "gpu_busy_us" in row["eagle3_trace"] and "gpu_timelines" in row["eagle3_trace"]
        assert row["eagle3_T0"]["compiles_while_timed"] == 0, row["eagle3_T0"]["compiled_while_timed"]
        # the dumped round program, profiled: one round loop of many kernels per iteration
        rounds = [p for p in row["hlo"] if p["program"] in ("jit_spec_run", "jit_spec_block", "jit_spec_decode")]
        assert rounds and all(p["loops"] and p["loops"][-1]["kernels"] >= 100 for p in rounds), row["hlo"]
    assert "| HEAD | - |" in r.stdout and "kernel / graph launches / GPU events" in r.stdout
    assert "programs compiled inside the timed passes" in r.stdout and "jit_spec_run:" in r.stdout

    env2 = {**env, "PROMPTS": "2", "NEW": "4", "HF": "eager static"}  # torch.compile's graphs need a GPU
    r = subprocess.run(["bash", JOB, "2"], env=env2, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (tmp_path / "out" / "part2.log").read_text()
    for dt in ("float32", "bfloat16"):
        assert f"== {dt}, jaxspec with XLA's defaults" in log
    assert log.count("speedup jaxspec / HF static (median)") == 2 and log.count("| jaxspec |") == 4

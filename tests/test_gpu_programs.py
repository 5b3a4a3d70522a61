"""The GPU's programs, compiled for an H100 on this machine (JAX's deviceless compilation, no GPU):
kernel budgets per decode step and per speculation round, command buffers, copies inside loops.

The budget test runs benchmarks/gpu/gpu_programs.py in a subprocess with JAX's CUDA plugin from
`.gpu-compile` (`make gpu-compile`, which `make test` runs first); without it the test is skipped.
A change that adds kernels to a loop iteration, stops a loop from being captured as one command
buffer, or copies more bytes per iteration fails here. When a change removes kernels, lower the
budget to the new count (the failure message of a later regression then points at the right change).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "gpu"))

import thunks  # noqa: E402

# (model, program) -> (kernels per iteration of its main loop, bytes copied per iteration), compiled
# for the H100 target at bfloat16, batch 1 (the server's: 8 slots); see gpu_programs.py for shapes
BUDGETS = {
    ("smollm2", "decode"): (168, 0),
    ("smollm2", "spec_block"): (276, 420),  # a few scalars and small index arrays; no KV
    ("smollm2", "spec_block_t1"): (300, 36),
    ("smollm2", "serve_spec"): (598, 448),  # the same for 8 slots (its program samples)
    ("llama8b", "decode"): (499, 0),  # XLA's GEMMs (jaxspec/models/fused_layer.py MAX_WEIGHT)
}

SEQUENCE = """\
001: kCopy  [source       | next=003 (2)] kCopy
002: kCopy  [source       | next=003 (1)] kCopy
003: kWhile [prev=002 (1) | sink        ]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    006: kCustomKernel [source       | next=007 (1)] gemm_fusion_dot_general_0 grid: [16, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
    007: kCopy         [prev=006 (1) | sink        ] kCopy
"""
CAPTURED = """\
000: kCommandBuffer [source | sink]
    001: kCopy  [source       | next=003 (2)] kCopy
    003: kWhile [prev=002 (1) | sink        ]
condition:
        004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        005: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        008: kWhile [prev=005 (1) | sink        ]
        condition:
            009: kCustomKernel [source | sink] inner_compare grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            010: kCustomKernel [source | sink] inner_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            011: kCustomKernel [source | sink] inner_fusion_2 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""
HLO = """\
  %copy.5 = bf16[8,256]{1,0} copy(%x), metadata={op_name="jit(f)/while/body/copy"}
  %gemm_fusion_dot_general.0 = bf16[8,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, metadata={op_name="jit(f)/while/body/closed_call/dot_general"}
"""
METADATA = 'thunk_metadata {\n  thunk_info {\n    profile_annotation: "copy.5"\n    thunk_id: 7\n  }\n}\n'


def test_thunk_sequence_counts_kernels_per_iteration():
    r = thunks.profile(SEQUENCE, HLO, METADATA)
    assert (r.outside, r.top_level, r.command_buffers) == (2, 3, 0)
    (loop,) = r.loops
    assert loop.kernels == 4 and loop.by_kind == {"kCustomKernel": 3, "kCopy": 1}
    assert loop.copy_bytes == 8 * 256 * 2 and not loop.captured
    assert loop.ops["dot_general"] == 1
    assert r.breakers == ["kCopy kCopy", "kCopy kCopy", "kWhile"]


def test_thunk_sequence_finds_captured_and_nested_loops():
    r = thunks.profile(CAPTURED)
    assert (r.command_buffers, r.top_level, r.breakers) == (1, 1, [])
    outer, inner = r.loops
    assert outer.path == "while 3" and outer.kernels == 2 and outer.nested == 1 and outer.captured
    assert inner.path == "while 3 > while 8" and inner.kernels == 3 and inner.captured
    assert r.main_loop() is inner


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{model: {program: report dict}} from one run of the tool per model."""
    if not os.path.isdir(os.path.join(REPO, ".gpu-compile", "jax_plugins")):
        pytest.skip("JAX's CUDA plugin is not in .gpu-compile (make gpu-compile)")
    out = {}
    for model in sorted({m for m, _ in BUDGETS}):
        path = tmp_path_factory.mktemp("gpu") / f"{model}.json"
        names = ",".join(p for m, p in BUDGETS if m == model)
        cmd = [
            sys.executable,
            os.path.join(REPO, "benchmarks", "gpu", "gpu_programs.py"),
            "--model",
            model,
            "--programs",
            names,
            "--json",
            str(path),
        ]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        with open(path) as f:
            out[model] = json.load(f)
    return out


@pytest.mark.parametrize(("model", "program"), list(BUDGETS))
def test_kernel_budget(compiled, model, program):
    report = compiled[model][program]
    loop = max(report["loops"], key=lambda lp: lp["kernels"])
    budget, copy_budget = BUDGETS[(model, program)]
    where = f"{model} {program} ({loop['path']}): {loop['kernels']} kernels per iteration {loop['by_kind']}"
    assert loop["captured"], f"{where}: the loop is not captured in a command buffer ({report['breakers']})"
    assert report["command_buffers"] >= 1 and report["host"] == 0, where
    assert loop["kernels"] <= budget, f"{where}, budget {budget}; largest groups: {loop['ops']}"
    assert loop["copy_bytes"] <= copy_budget, f"{where}: {loop['copy_bytes']} bytes copied per iteration"
    if loop["kernels"] < budget:  # say so, so that the budget follows the cut
        print(f"{where}: under its budget of {budget}; lower it to {loop['kernels']}")

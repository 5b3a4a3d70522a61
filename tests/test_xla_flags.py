"""jaxspec's GPU XLA flags: added to XLA_FLAGS on CUDA machines before the backend starts, never over
a flag the user set, and not at all with the off switch or a CPU-only JAX_PLATFORMS."""

from __future__ import annotations

import pytest

from jaxspec import xla_flags
from jaxspec.xla_flags import GPU_DEFAULTS, apply_gpu_defaults, with_gpu_defaults

FLAG = "--xla_gpu_enable_command_buffer"


MIN = "--xla_gpu_graph_min_graph_size"


def test_with_gpu_defaults_adds_only_what_the_user_left_unset():
    assert with_gpu_defaults("") == f"{FLAG}={GPU_DEFAULTS[FLAG]} {MIN}=1"
    assert GPU_DEFAULTS[FLAG] == "+WHILE,+CONDITIONAL"
    mine = f"--xla_dump_to=/tmp/d {FLAG}= {MIN}=5"
    assert with_gpu_defaults(mine) == mine  # theirs wins, even an empty list (no command buffers at all)
    assert (
        with_gpu_defaults(f"--xla_dump_to=/tmp/d {MIN}=3") == f"--xla_dump_to=/tmp/d {MIN}=3 {FLAG}=+WHILE,+CONDITIONAL"
    )
    assert with_gpu_defaults("--xla_dump_to=/tmp/d") == f"--xla_dump_to=/tmp/d {FLAG}=+WHILE,+CONDITIONAL {MIN}=1"


@pytest.mark.parametrize(
    ("env", "plugin", "added"),
    [
        ({}, True, True),
        ({"JAX_PLATFORMS": "cuda"}, True, True),
        ({"JAX_PLATFORMS": "cpu"}, True, False),
        ({"JAXSPEC_GPU_XLA_DEFAULTS": "0"}, True, False),
        ({}, False, False),
        ({"XLA_FLAGS": f"{FLAG}=FUSION --xla_gpu_graph_min_graph_size=2"}, True, False),
    ],
)
def test_apply_gpu_defaults(monkeypatch, env, plugin, added):
    monkeypatch.setattr(xla_flags, "has_cuda_plugin", lambda: plugin)
    environ = dict(env)
    assert apply_gpu_defaults(environ) is added
    assert (f"{FLAG}=+WHILE,+CONDITIONAL" in environ.get("XLA_FLAGS", "")) is added
    if "XLA_FLAGS" in env:
        assert environ["XLA_FLAGS"] == env["XLA_FLAGS"]

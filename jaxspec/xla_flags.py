"""jaxspec's default XLA flags on NVIDIA GPUs, set before the backend starts.

A decode dispatch and a speculation dispatch are each one XLA program whose rounds run in a
`lax.while_loop`. XLA:GPU records runs of kernels as CUDA graphs ("command buffers"), but by default
not `while` loops or conditionals, so every loop iteration launches its hundreds of kernels one by
one, and a 135M-parameter model at batch 1 is bound by those launches. With WHILE and CONDITIONAL
added, a loop whose body XLA can capture whole replays as one graph per dispatch.

XLA forms a command buffer only from a run of at least `xla_gpu_graph_min_graph_size` thunks (5 by
default) at a program's top level, and it does not look inside a `while` it could capture whole. A
program that is nothing but its loop (adaptive speculation's block of rounds: a counter copy and
the `while`, two thunks) therefore got no graph at all, and launched its ~650 kernels a round one
by one, while the same rounds inside a longer program were one graph. A minimum of 1 captures
every such loop; the cost is that tiny programs are recorded as graphs too, once per program, where
XLA's default would launch their few kernels directly (benchmarks/gpu/gpu_programs.py shows which
programs get a command buffer, compiled for an H100 on any machine).

`apply_gpu_defaults()` runs when `jaxspec` is imported: on a machine with JAX's CUDA plugin it adds
these flags to `XLA_FLAGS`, except a flag the user's `XLA_FLAGS` already sets (theirs wins), and
nothing at all when `JAXSPEC_GPU_XLA_DEFAULTS=0` (XLA's own defaults then apply). XLA reads `XLA_FLAGS` once, when the first backend starts: a program
that used JAX before importing jaxspec keeps the flags it started with.
"""

from __future__ import annotations

import importlib.util
import os

# flag name -> value jaxspec uses on GPUs
GPU_DEFAULTS: dict[str, str] = {
    "--xla_gpu_enable_command_buffer": "+WHILE,+CONDITIONAL",
    "--xla_gpu_graph_min_graph_size": "1",
}
OFF_SWITCH = "JAXSPEC_GPU_XLA_DEFAULTS"  # "0": add nothing
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def with_gpu_defaults(xla_flags: str) -> str:
    """`xla_flags` with every GPU default the string does not set already appended."""
    have = {f.split("=", 1)[0] for f in xla_flags.split()}
    added = [f"{name}={value}" for name, value in GPU_DEFAULTS.items() if name not in have]
    return " ".join([xla_flags.strip(), *added]).strip()


def has_cuda_plugin() -> bool:
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def apply_gpu_defaults(environ=os.environ) -> bool:
    """Adds the GPU defaults to environ["XLA_FLAGS"] where they apply; True if anything was added."""
    if environ.get(OFF_SWITCH, "1") == "0":
        return False
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms.lower() for p in ("cuda", "gpu")):
        return False
    if not has_cuda_plugin():
        return False
    before = environ.get("XLA_FLAGS", "")
    after = with_gpu_defaults(before)
    if after != before.strip():
        environ["XLA_FLAGS"] = after
        return True
    return False

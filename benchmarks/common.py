"""Shared benchmark helpers: MT-bench prompts, machine description, memory bandwidth."""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from jaxspec.args import ModelArgs
from jaxspec.bench import mtbench_first_turns  # noqa: F401 (re-exported for the benchmark scripts)
from jaxspec.cli_flags import add_arguments

# The benchmarks' context length (all but bench_startup, which measures the default server): short,
# so that the servers and engines a benchmark starts side by side fit in memory together.
BENCH_CONTEXT = 2048


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import jax

    dev = jax.devices()[0]
    return f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__} on {dev.platform}:{dev.device_kind}"


def add_model_arguments(ap: argparse.ArgumentParser, context_length: int | None, *fields: str) -> None:
    """--model-path, --context-length and `fields`, declared once (in ModelArgs) for every benchmark.

    context_length: this benchmark's default (None: the model's own, as `jaxspec serve` has it).
    """
    add_arguments(ap, ModelArgs, title="model", only=("model_path", "context_length", *fields))
    if context_length is not None:
        ap.set_defaults(context_length=context_length)
        for action in ap._actions:
            if action.dest == "context_length":
                action.help = f"maximum prompt + output tokens (default here: {context_length})"


def copy_bandwidth(nbytes: int = 1 << 29, reps: int = 5) -> float:
    """Best memcpy bandwidth in bytes/s, counting bytes read + bytes written."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def jax_read_bandwidth(nbytes: int = 1 << 29, reps: int = 5) -> float:
    """Best read bandwidth, bytes/s, of two jitted XLA programs over `nbytes`: a float32 reduction
    and a batch-1 bf16 matrix-vector product (what a weight-bound decode step does). On an H100 the
    reduction alone reached less than decoding itself did, so the better of the two is the roofline."""
    import jax
    import jax.numpy as jnp

    cols = 4096
    progs = [
        (jax.jit(jnp.sum), (jnp.ones((nbytes // 4,), jnp.float32),)),
        (
            jax.jit(jnp.dot),
            (jnp.ones((1, nbytes // 2 // cols), jnp.bfloat16), jnp.ones((nbytes // 2 // cols, cols), jnp.bfloat16)),
        ),
    ]
    best = float("inf")
    for f, args in progs:
        f(*args).block_until_ready()
        for _ in range(reps):
            t = time.perf_counter()
            f(*args).block_until_ready()
            best = min(best, time.perf_counter() - t)
    return nbytes / best


def synthetic_layers_ms(hidden: int, inter: int, kv: int, layers: int, reps: int = 20) -> float:
    """Best time of a jitted batch-1 loop of `layers` Llama-shaped matvecs (q, k, v, o, gate, up, down)
    with no attention, norms, LM head or sampling: the floor for the layer stack under XLA:CPU."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    shapes = [
        (hidden, hidden),
        (hidden, kv),
        (hidden, kv),
        (hidden, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ]
    ws = [[jax.random.normal(key, s, jnp.float32) * 0.02 for s in shapes] for _ in range(layers)]

    def f(ws, x):
        for q, k, v, o, g, u, d in ws:
            a = (x @ q) * jnp.tanh(jnp.sum(x @ k) + jnp.sum(x @ v))
            x = x + a @ o
            x = x + (jax.nn.silu(x @ g) * (x @ u)) @ d
        return x

    j = jax.jit(f)
    x = jnp.ones((1, hidden), jnp.float32)
    j(ws, x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        j(ws, x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best * 1e3

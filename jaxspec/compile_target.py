"""The platform jaxspec builds its programs for: the one it runs on, or a GPU it compiles for.

Every choice jaxspec makes by platform (the attention backend, Pallas interpret mode, the CPU's
out-major weight layout and native kernels, the draft tree shape, the server's batch defaults)
asks `platform()` here, never `jax.default_backend()` directly. Normally the two agree. Inside
`compiling_for("gpu")` they do not: on a machine without a GPU, the engine then prepares its
models and traces its programs exactly as it would on a GPU, so that they can be lowered and
compiled for a GPU described by a topology (JAX's deviceless compilation, with the CUDA plugin
installed and `JAX_PLATFORMS=cpu`) and their kernels counted without one
(benchmarks/gpu/gpu_programs.py). Nothing is run for the target there: the programs are only
compiled, so start-up self-checks that would run a kernel are skipped (`deviceless()`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

PLATFORMS = ("cpu", "gpu")
_target: str | None = None  # set by compiling_for


def platform() -> str:
    """ "gpu" or "cpu" (or another JAX backend name): what programs are built for."""
    return _target or jax.default_backend()


def deviceless() -> bool:
    """True while programs are built for a platform this process does not run on."""
    return _target is not None and _target != jax.default_backend()


@contextlib.contextmanager
def compiling_for(name: str) -> Iterator[None]:
    """Builds models and programs for platform `name` ("gpu" or "cpu") inside the block."""
    global _target
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; available: {', '.join(PLATFORMS)}")
    before, _target = _target, name
    try:
        yield
    finally:
        _target = before

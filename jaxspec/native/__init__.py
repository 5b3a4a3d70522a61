"""Native XLA:CPU kernels, called from inside the compiled programs through XLA's FFI.

`int8_matmul`, the integer product of w8a8_int8 on CPU for a few rows (a decoding step,
a verification tree, a batch of slots; models/llama.py:int8_matmul picks it). XLA:CPU's own int8
dot streams the weights at about half the rate of its float32 matrix-vector product, so w8a8 read
a quarter of the bytes in more than half the time (benchmarks/RESULTS.md). This kernel streams each
out-major int8 weight [O, I] once per call for up to 8 rows, with AVX-512 VNNI dot products where
the CPU has them, AVX2 multiply-adds where not, and a plain loop elsewhere (int8_matmul.cc).

The source (int8_matmul.cc, beside this file) is compiled on first use with the system's C++
compiler (`$CXX`, else c++ / g++) and `-march=native` into the jaxspec cache
($JAXSPEC_CACHE_DIR/native, default ~/.cache/jaxspec/native), keyed by the source, the CPU and the
jax version. Without a compiler, or with JAXSPEC_NATIVE_KERNELS=0, `available()` is False and
the engine keeps XLA's int8 dot (a failure is logged once). GPUs and tensor-parallel engines never
use it (XLA cannot partition a custom call).

The other: host_call.py, calls from a compiled program back into Python (constrained decoding's
grammar masks) that, unlike jax.pure_callback, JAX's persistent compilation cache can keep.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from jaxspec.paths import cache_dir

logger = logging.getLogger(__name__)
ENV = "JAXSPEC_NATIVE_KERNELS"
SOURCE = os.path.join(os.path.dirname(__file__), "int8_matmul.cc")
TARGET = "jaxspec_int8_matmul"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)


def _build(source: str = SOURCE) -> str:
    """Compiles a source file of this folder (once per source, CPU and jax version) and returns the
    shared library's path."""
    with open(source, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + _cpu_id().encode() + jax.__version__.encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "native")
    lib = os.path.join(out_dir, f"{os.path.splitext(os.path.basename(source))[0]}-{key}.so")
    if os.path.exists(lib):
        return lib
    logger.info("compiling %s for this CPU (once): %s", os.path.basename(source), lib)
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # built aside, then renamed: no reader sees half a file
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]
    res = subprocess.run([*cmd, source, "-o", tmp], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{cxx} failed: {res.stderr.strip()[-500:]}")
    os.replace(tmp, lib)
    return lib


@functools.cache
def _register(path: str) -> None:
    """Loads the library and registers its handler with XLA (once per library)."""
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxspecInt8Matmul), platform="cpu")


@functools.cache
def available() -> bool:
    """True when the kernel is compiled, loaded and registered for XLA:CPU (the default backend is
    the CPU and JAXSPEC_NATIVE_KERNELS is not 0)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if jax.default_backend() != "cpu":
        return False
    try:
        _register(_build())
    except Exception as e:  # no compiler, a failed build, an FFI mismatch: XLA's int8 dot instead
        logger.warning("native int8 kernel unavailable (%s); w8a8_int8 uses XLA's int8 dot", str(e).splitlines()[0])
        return False
    return True


def int8_matmul(xq, w):
    """xq [R, I] int8 times an out-major int8 weight w [O, I] -> [R, O] int32 (exact), on one thread.
    (Two calls over halves of the columns ran no faster: XLA:CPU did not run them at once.)"""
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((xq.shape[0], w.shape[0]), jnp.int32))(xq, w)

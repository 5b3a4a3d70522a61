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

`gguf_matmul`, GGUF weight blocks (Q4_0, Q4_1, Q8_0) multiplied as the file stores them, for
`--quantization gguf` (jaxspec/gguf.py): each block's 4- or 8-bit weights times the activations
quantized per block of 32, as llama.cpp multiplies them (gguf_matmul.cc). Same build, same paths.

`attention`, attention for a few query rows per slot over a float32 KV cache (attention.cc), which
jaxspec/attention.py's xla backend uses on a CPU: a row's result depends only on the columns it
sees, not on the buffer's length or the other rows, so verification and plain decoding agree bit
for bit. Same build, same paths; without it attention stays in XLA (logged).

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
import numpy as np

from jaxspec import compile_target
from jaxspec.errors import JaxspecError
from jaxspec.paths import cache_dir

logger = logging.getLogger(__name__)
ENV = "JAXSPEC_NATIVE_KERNELS"
SOURCE = os.path.join(os.path.dirname(__file__), "int8_matmul.cc")
TARGET = "jaxspec_int8_matmul"
GGUF_SOURCE = os.path.join(os.path.dirname(__file__), "gguf_matmul.cc")
GGUF_TARGET = "jaxspec_gguf_matmul"
ATTENTION_SOURCE = os.path.join(os.path.dirname(__file__), "attention.cc")
ATTENTION_TARGET = "jaxspec_attention"
# GGML type ids of the block formats gguf_matmul multiplies, and each block's bytes (32 weights)
GGUF_BLOCKS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
# their interleaved layouts (8 weight rows side by side, jaxspec/gguf.py `interleave`): id, bytes per
# group of 8 rows and block
GGUF_X8 = {"Q4_0x8": (102, 144), "Q4_1x8": (103, 160), "Q8_0x8": (108, 272)}


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
def _register(path: str, symbol: str, target: str) -> None:
    """Loads the library and registers its handler `symbol` with XLA as `target` (once per library)."""
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def enabled() -> bool:
    """False where native kernels cannot run: JAXSPEC_NATIVE_KERNELS=0, or a default backend other
    than the CPU."""
    return (
        os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")
        and compile_target.platform() == "cpu"
    )


def _load(source: str, symbol: str, target: str) -> str | None:
    """Builds and registers one kernel; None when it is ready, else why not (one line)."""
    if not enabled():
        return f"disabled ({ENV}=0 or not on a CPU)"
    try:
        _register(_build(source), symbol, target)
    except Exception as e:  # no compiler, a failed build, an FFI mismatch
        return str(e).splitlines()[0]
    return None


@functools.cache
def available() -> bool:
    """True when the int8 kernel is compiled, loaded and registered for XLA:CPU (the default backend
    is the CPU and JAXSPEC_NATIVE_KERNELS is not 0)."""
    why = _load(SOURCE, "JaxspecInt8Matmul", TARGET)
    if why is not None and enabled():
        logger.warning("native int8 kernel unavailable (%s); w8a8_int8 uses XLA's int8 dot", why)
    return why is None


@functools.cache
def gguf_unavailable() -> str | None:
    """None when the GGUF block kernel (gguf_matmul.cc) is ready on XLA:CPU, else why not: the
    `gguf` quantization has no other path, so the caller reports it."""
    return _load(GGUF_SOURCE, "JaxspecGgufMatmul", GGUF_TARGET)


@functools.cache
def attention_unavailable() -> str | None:
    """None when the attention kernel (attention.cc) is ready on XLA:CPU, else why not."""
    return _load(ATTENTION_SOURCE, "JaxspecAttention", ATTENTION_TARGET)


def int8_matmul(xq, w):
    """xq [R, I] int8 times an out-major int8 weight w [O, I] -> [R, O] int32 (exact), on one thread.
    (Two calls over halves of the columns ran no faster: XLA:CPU did not run them at once.)"""
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((xq.shape[0], w.shape[0]), jnp.int32))(xq, w)


def gguf_matmul(x, w, kind: str, norm=None):
    """x [R, I] float32 times GGUF blocks w [O, I / 32 * block bytes] uint8 of type `kind` (a key of
    GGUF_BLOCKS; row o of w holds weight row o), or their interleaved layout [O / 8, I / 32 * group
    bytes] (a key of GGUF_X8) -> [R, O] float32, activations quantized per block of 32 as llama.cpp
    does (gguf_matmul.cc), the weight rows split over the kernel's threads. norm: (weight [I], eps)
    of an RMSNorm applied to each row of x first, inside the kernel, or None."""
    why = gguf_unavailable()  # builds and registers it on first use
    if why is not None:
        raise JaxspecError(f"the native GGUF kernel is unavailable: {why}")
    kind_id, out = (GGUF_X8[kind][0], 8 * w.shape[0]) if kind in GGUF_X8 else (GGUF_BLOCKS[kind][0], w.shape[0])
    weight, eps = (jnp.zeros((0,), jnp.float32), 0.0) if norm is None else norm
    return jax.ffi.ffi_call(GGUF_TARGET, jax.ShapeDtypeStruct((x.shape[0], out), jnp.float32))(
        x, w, jnp.asarray(weight, jnp.float32), kind=np.int32(kind_id), eps=np.float32(eps)
    )


def attention(q, k, v, kv_len, offset, local_mask, sliding_window: int | None):
    """Attention over a per-slot float32 KV cache, a row's output bitwise independent of the buffer's
    length and of the other rows (attention.cc). q: [B, T, H, D]; k, v: [B, S, Hkv, D]; kv_len: [B]
    int32; offset: int32 scalar; local_mask: [B, T, W] bool, or None for causal rows. Returns
    [B, T, H, D] float32. The visibility rules are jaxspec/attention.py's."""
    why = attention_unavailable()
    if why is not None:
        raise JaxspecError(f"the native attention kernel is unavailable: {why}")
    b, t = q.shape[:2]
    mask = jnp.zeros((b, t, 0), jnp.uint8) if local_mask is None else local_mask.astype(jnp.uint8)
    return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32),
        k,
        v,
        kv_len.astype(jnp.int32),
        jnp.asarray(offset, jnp.int32),
        mask,
        window=np.int32(sliding_window or 0),
    )

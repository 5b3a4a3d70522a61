"""Calls from a compiled XLA:CPU program back into Python that the persistent compilation cache keeps.

`host_call(fn, result_shape_dtypes, *args, name=...)` behaves as
`jax.pure_callback(fn, result_shape_dtypes, *args)`: fn runs on the host with numpy arrays and
returns numpy arrays of the declared shapes. JAX never writes a program holding a pure_callback to
its persistent compilation cache (the callback is a Python object inside the executable), so every
server start compiled its constrained-decoding programs again, about 20 s each on a 2-core CPU.
Here the program holds an FFI custom call (host_call.cc) whose only link to Python is an integer
attribute: a hash of `name` and the argument and result shapes, looked up in a table that tracing
fills. Loading a cached program traces it first (JAX computes its cache key from the traced
program), so the table is always filled before a program runs.

`name` must tell apart every function that can be called with the same shapes (include the values
a functools.partial binds). Where the native library is unavailable (not on a CPU, no C++
compiler, JAXSPEC_NATIVE_KERNELS=0) host_call is jax.pure_callback.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxspec import native

logger = logging.getLogger(__name__)
SOURCE = os.path.join(os.path.dirname(__file__), "host_call.cc")
TARGET = "jaxspec_host_call"
_HostFn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p))

Spec = tuple[tuple[int, ...], np.dtype]
_table: dict[int, tuple[Callable, list[Spec], list[Spec], str]] = {}  # fn id -> (fn, args, results, name)


def _view(addr: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The buffer at `addr` as a numpy array (no copy)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    buf = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
    return np.frombuffer(buf, dtype).reshape(shape)


def _entry(fn_id: int, n: int, ptrs: Any) -> int:
    """What host_call.cc calls: runs the function of `fn_id` on the n buffers (arguments, then results)."""
    name = "?"
    try:
        fn, ins, outs, name = _table[fn_id]
        views = [_view(ptrs[i], shape, dtype) for i, (shape, dtype) in enumerate(ins + outs)]
        got = fn(*views[: len(ins)])
        got = got if isinstance(got, (tuple, list)) else (got,)
        for dst, value in zip(views[len(ins) :], got, strict=True):
            np.copyto(dst, np.asarray(value).reshape(dst.shape), casting="same_kind")
        return 0
    except Exception:  # reported to the program as an error, and logged here with its traceback
        logger.exception("host call %s failed", name)
        return 1


_c_entry = _HostFn(_entry)  # kept alive for as long as the library may call it
_local = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """The names of the host calls traced inside the block on this thread (a program holding one
    runs only in a process that traced it: its function is found through the table tracing fills)."""
    prev = getattr(_local, "names", None)
    names: list[str] = []
    _local.names = names
    try:
        yield names
    finally:
        _local.names = prev


@functools.cache
def available() -> bool:
    """True when the handler is built, loaded and registered for XLA:CPU (see native.available)."""
    if not native.enabled():
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(native._build(SOURCE))
        lib.JaxspecSetHostCall.argtypes = [_HostFn]
        lib.JaxspecSetHostCall(_c_entry)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxspecHostCall), platform="cpu")
    except Exception as e:  # no compiler, a failed build: pure_callback, whose programs are not cached
        logger.warning("native host calls unavailable (%s); using jax.pure_callback", str(e).splitlines()[0])
        return False
    return True


def _spec(x: Any) -> Spec:
    return tuple(int(d) for d in x.shape), np.dtype(x.dtype)


def host_call(fn: Callable, result_shape_dtypes: Any, *args: Any, name: str, vmap_method: str = "sequential"):
    """jax.pure_callback(fn, result_shape_dtypes, *args, vmap_method=...) in a program that the
    persistent compilation cache keeps (the module docstring). name: unique per function (and per
    value a partial binds) among those called with the same shapes."""
    names = getattr(_local, "names", None)
    if names is not None:
        names.append(name)
    if not available():
        return jax.pure_callback(fn, result_shape_dtypes, *args, vmap_method=vmap_method)
    results = result_shape_dtypes if isinstance(result_shape_dtypes, (tuple, list)) else (result_shape_dtypes,)
    ins, outs = [_spec(a) for a in args], [_spec(r) for r in results]
    digest = hashlib.sha256(repr((name, ins, outs)).encode()).digest()
    fn_id = int.from_bytes(digest[:8], "little") >> 1  # a positive int64
    _table.setdefault(fn_id, (fn, ins, outs, name))
    call = jax.ffi.ffi_call(TARGET, result_shape_dtypes, vmap_method=vmap_method)
    return call(*args, fn=np.int64(fn_id))

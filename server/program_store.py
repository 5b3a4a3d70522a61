"""The server's compiled programs on disk, loaded at the next start without tracing them.

JAX's persistent compilation cache (jaxspec/compile_cache.py) saves the compiling, but a program
must still be traced and lowered before JAX can look it up: about 1.2 s of Python per speculative
dispatch program on a 2-core CPU, under the GIL, so a restart spent about 40 s tracing its
start-up programs one at a time. This store keeps each compiled program as JAX serializes it
(jax.experimental.serialize_executable) and loads it in about a second, with no tracing.

A stored program is used only when everything it was built from is the same: the program's key
and the scheduler's static signature (model structure, draft, tree shape, slots, shapes, dtypes
and shardings of every input), the source of every jaxspec module, the versions of jax, jaxlib,
flax and numpy, XLA_FLAGS and the JAX_*/JAXSPEC_* environment, the devices, and the module
switches that change what a program computes (`switches()`; a new switch of that kind must be
added there). Anything else that differed would fail loudly, not silently: a loaded program
checks the structure, shapes and shardings of its arguments at every call. Programs holding a
host callback are not stored (their callback table is filled by tracing), and neither are those
JAX's cache supplied: XLA:CPU serializes a program it loaded from its cache without its kernels
(it then fails to run: "Function ... not found"), so only a program XLA compiled in this process
is written (`compile_fresh`). After an upgrade, programs whose XLA code did not change come from
JAX's cache at the first start; the server then compiles them again in the background, with a
debug option JAX's cache key includes and XLA's code ignores set to a random value so that JAX's
cache cannot supply them (`compile_again`; each leaves one unused entry in JAX's cache), and stores
them for the next start.

Files live in `programs/` beside the compilation cache (`<cache>/jaxspec-programs`), one per
program, written atomically; past MAX_BYTES the least recently used are deleted. No cache, no
store (JAXSPEC_COMPILATION_CACHE=off), and none across several hosts.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import random
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import serialize_executable

logger = logging.getLogger("jaxspec.server")

MAX_BYTES = 4 << 30  # the store's size cap (least recently used files go first)
VERSION = 1


_local = threading.local()


def _on_event(event: str, **_: Any) -> None:
    # recorded on the thread that compiles, as it writes what XLA compiled to JAX's cache
    if event == "/jax/compilation_cache/cache_misses":
        _local.compiled = True


jax.monitoring.register_event_listener(_on_event)


def compile_fresh(compile: Callable[[], Any]) -> tuple[Any, bool]:
    """(compile(), whether XLA compiled it just now: not from JAX's persistent cache, nor from its
    in-memory one, which may hold a program loaded from the persistent cache). compile: a
    Lowered's compile method."""
    _local.compiled = False
    prog = compile()
    return prog, _local.compiled


def compile_again(lowered: Any) -> tuple[Any, bool]:
    """compile_fresh, past JAX's caches: the XLA debug option below (how many buffers a buffer
    assignment dump lists) is part of JAX's cache key and changes nothing in the program."""
    options = {"xla_debug_buffer_assignment_show_max": random.randrange(1 << 40)}
    return compile_fresh(lambda: lowered.compile(compiler_options=options))


def switches() -> dict[str, Any]:
    """Module switches that change what a traced program computes."""
    from jaxspec import native, sampling
    from jaxspec.native import host_call

    return {
        "sampling.SKIP_UNUSED": sampling.SKIP_UNUSED,
        "native.available": native.available(),
        "native.attention": native.attention_unavailable() is None,
        "host_call.available": host_call.available(),
    }


@functools.cache
def source_digest() -> str:
    """sha256 of every .py and .cc file of the jaxspec package (the folders it installs included)."""
    import jaxspec
    import jaxspec.pallas_kernels
    import jaxspec.server

    h = hashlib.sha256()
    roots = sorted({os.path.realpath(m.__path__[0]) for m in (jaxspec, jaxspec.server, jaxspec.pallas_kernels)})
    for root in roots:
        for folder, dirs, files in sorted(os.walk(root)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".cc")):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _environment() -> tuple:
    import flax
    import jaxlib
    import numpy

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAX_", "JAXSPEC_", "XLA_")))
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    versions = (sys.version, jax.__version__, jaxlib.__version__, flax.__version__, numpy.__version__)
    return VERSION, versions, source_digest(), env, devices, sorted(switches().items())


def store_path() -> str | None:
    """The store's folder (None: no persistent compilation cache, or several hosts)."""
    from jaxspec.compile_cache import enable

    cache = enable()
    if cache is None or jax.process_count() > 1:
        return None
    return os.path.join(cache, "jaxspec-programs")


class ProgramStore:
    """Compiled programs on disk under `folder`, for one scheduler's static signature (`context`:
    anything picklable that tells schedulers apart; the environment is added here)."""

    def __init__(self, folder: str, context: Any):
        self.folder = folder
        self.context = hashlib.sha256(pickle.dumps((_environment(), context))).hexdigest()
        self.saved = 0

    def _path(self, key: tuple) -> str:
        name = hashlib.sha256(pickle.dumps((self.context, key))).hexdigest()[:32]
        return os.path.join(self.folder, f"{name}.program")

    def load(self, key: tuple, in_tree: Any) -> Any | None:
        """The stored program for `key`, or None (not stored, or unreadable: logged, then compiled).
        in_tree: the structure of the arguments it will be called with (the stored one holds copies
        of the draft's proposer, which compares equal only to itself)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                payload, stored_tree, out_tree = pickle.load(f)
            if stored_tree.num_leaves != in_tree.num_leaves:
                raise ValueError(f"{stored_tree.num_leaves} arguments stored, {in_tree.num_leaves} expected")
            prog = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception as e:
            logger.warning("stored program %s unreadable (%s: %s): compiling it", key, type(e).__name__, e)
            return None
        try:
            os.utime(path)  # recently used
        except OSError:
            pass
        return prog

    def save(self, key: tuple, prog: Any) -> None:
        """Writes `prog` for `key` (atomically); a program JAX cannot serialize is skipped."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(prog)
            data = pickle.dumps((payload, in_tree, out_tree))
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except Exception as e:
            logger.info("program %s not stored (%s: %s)", key, type(e).__name__, e)
            return
        self.saved += 1
        self._trim()

    def _trim(self) -> None:
        """Deletes the least recently used files while the store is over MAX_BYTES."""
        try:
            files = [os.path.join(self.folder, n) for n in os.listdir(self.folder) if n.endswith(".program")]
            stats = sorted((os.stat(p).st_mtime, os.stat(p).st_size, p) for p in files)
        except OSError:
            return
        total = sum(size for _, size, _ in stats)
        for _, size, path in stats:
            if total <= MAX_BYTES:
                break
            try:
                os.unlink(path)
                total -= size
            except OSError:
                pass

"""Shared fixtures: tiny random HF models (built with torch, the reference) and the default model.
The helpers and constants test modules share are in tests/helpers.py."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest

from jaxspec.xla_flags import has_cuda_plugin

from helpers import FAMILIES, make_hf_model

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Most of the suite's time is XLA:CPU compiling. LLVM's optimisation level 0 for the kernels it emits
# compiles a quarter faster (tests/test_speculative.py: 99 s against 131 s, AMD EPYC, 2 cores); the
# XLA programs (their HLO, which tests read) are the same, and the tests' models are tiny, so the
# slower kernels cost little. Set before JAX starts its backend; subprocesses inherit it. A level
# the caller set is kept, and a machine with JAX's CUDA plugin (GPU tests) keeps XLA's default.
_OPT = "--xla_backend_optimization_level"
if _OPT not in os.environ.get("XLA_FLAGS", "") and not has_cuda_plugin():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT}=0".strip()
# A persistent compilation cache private to this run (hermetic: it starts empty and is removed at
# exit). Many tests start engines and servers over the same tiny models, and programs dropped to
# free memory mappings (below) come back from it instead of compiling again; subprocesses share it.
# `make test` runs two pytest-xdist workers; each has its own cache (and so do the subprocesses it
# starts): XLA writes cache files in place without a lock, so two processes compiling at once must
# not share a directory. A cache the caller chose (JAXSPEC_COMPILATION_CACHE) is kept.
_CACHE = tempfile.mkdtemp(prefix="jaxspec-test-xla-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
if os.environ.get("JAXSPEC_COMPILATION_CACHE") in (None, os.environ.get("JAXSPEC_TEST_CACHE")):
    os.environ["JAXSPEC_COMPILATION_CACHE"] = os.environ["JAXSPEC_TEST_CACHE"] = _CACHE


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _drop_compiled_programs() -> None:
    import gc
    import sys

    import jax

    jax.clear_caches()
    for module in ("jaxspec.server.programs", "jaxspec.engine"):
        if module in sys.modules:
            sys.modules[module].clear_cache()
    gc.collect()


# Every XLA:CPU executable keeps its own memory mappings (a few hundred for a model program); the
# suite compiles enough programs to pass the kernel's limit of 65530 mappings per process
# (vm.max_map_count), and LLVM then crashes inside a compile (SIGSEGV). One test module of server
# tests alone can add 40,000. Session-scoped engines stay usable: their functions recompile on next use.
MAPPINGS_BEFORE_DROP = 24_000


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_per_module():
    """Drops JAX's compiled programs after each test module."""
    yield
    _drop_compiled_programs()


@pytest.fixture(autouse=True)
def _free_compiled_programs_when_many():
    """Drops them after any test that leaves the process with many memory mappings."""
    yield
    if _memory_mappings() > MAPPINGS_BEFORE_DROP:
        _drop_compiled_programs()


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """family -> (HF model dir with config.json + model.safetensors, torch model)."""
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        m = make_hf_model(fam)
        m.save_pretrained(d, safe_serialization=True)
        out[fam] = (str(d), m)
    return out


@pytest.fixture(scope="session")
def default_engine():
    import jaxspec

    # the plain float32 reference (the default on a CPU would keep the GGUF's own blocks: gguf)
    return jaxspec.Engine(show_progress=False, dtype="float32", speculative_algorithm="NONE")


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)

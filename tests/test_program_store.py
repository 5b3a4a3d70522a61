"""The server's compiled programs on disk (server/program_store.py): a second start loads every
start-up program that XLA compiled at the first one, without tracing, and serves the same tokens;
programs JAX's cache supplied are compiled again past it and stored; programs holding a host
callback are never stored; an unreadable file is compiled instead. Each start runs in a child
process with a persistent cache of its own (this file run as a script)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from helpers import model_dirs  # noqa: F401  (fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[5, 6, 7, 8, 9] * 3, [40, 41, 42]]


def start(model: str, cache: str, **env: str) -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu", JAXSPEC_COMPILATION_CACHE=cache, **env)
    p = subprocess.run([sys.executable, __file__, model], capture_output=True, text=True, env=e, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_start_loads_the_stored_programs(model_dirs, tmp_path):  # noqa: F811
    cache = str(tmp_path / "xla")
    first = start(model_dirs["target"], cache)
    assert first["saved"] and first["loaded"] == []
    assert first["grammar_stored"] == [] and first["others_stored"] == first["others"]
    second = start(model_dirs["target"], cache)
    assert second["loaded"] == first["saved"] and second["saved"] == [], (first, second)
    assert second["traced"] == second["grammar"] and second["tokens"] == first["tokens"]
    # another context (an upgrade, say): JAX's cache supplies the programs; they are compiled again and stored
    third = start(model_dirs["target"], cache, JAXSPEC_STORE_TEST="upgrade", STORE_AGAIN="1")
    assert third["loaded"] == [] and third["saved"] == [] and third["stored_again"] == len(first["saved"]), third
    before, unstored, after = third["left"]
    assert unstored == len(first["saved"]) and before - after == unstored, third
    fourth = start(model_dirs["target"], cache, JAXSPEC_STORE_TEST="upgrade")
    assert fourth["loaded"] == first["saved"] and fourth["tokens"] == first["tokens"]
    # an unreadable file: logged and compiled, the tokens unchanged
    folder = os.path.join(cache, "jaxspec-programs")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"not a program")
    fifth = start(model_dirs["target"], cache, JAXSPEC_STORE_TEST="upgrade")
    assert fifth["loaded"] == [] and fifth["tokens"] == first["tokens"]


def test_store_round_trip_and_bad_files(tmp_path, caplog):
    """In one process: a program XLA compiled here is stored and loads back (the live argument
    structure given), runs to the same result; one JAX's in-memory cache returned is not fresh;
    a damaged file is logged and reads as missing."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.compile_cache import enable
    from jaxspec.server.program_store import ProgramStore, compile_again, compile_fresh

    assert enable() is not None  # the run's own cache (tests/conftest.py): "fresh" means written to it
    # an engine built earlier in this worker may have set the package logger's level (--log-level)
    caplog.set_level(logging.WARNING, logger="jaxspec.server")
    salt = float(np.random.default_rng().integers(1 << 30))  # a program no cache has seen
    f = jax.jit(lambda x, y: {"sum": jnp.sin(x) @ y + salt})
    args = (jnp.ones((8, 8)), jnp.full((8, 8), 0.5))
    lowered = f.lower(*args)
    prog, fresh = compile_fresh(lowered.compile)
    assert fresh
    assert not compile_fresh(f.lower(*args).compile)[1]  # the same program again: from a cache
    store = ProgramStore(str(tmp_path), "context")
    store.save(("k",), prog)
    back = store.load(("k",), lowered.in_tree)
    np.testing.assert_allclose(back(*args)["sum"], prog(*args)["sum"])
    assert store.load(("other",), lowered.in_tree) is None
    assert ProgramStore(str(tmp_path), "another context").load(("k",), lowered.in_tree) is None
    with open(store._path(("k",)), "wb") as fh:
        fh.write(b"damaged")
    assert store.load(("k",), lowered.in_tree) is None
    assert "unreadable" in caplog.text
    assert compile_again(f.lower(*args))[1]  # past JAX's caches: XLA compiles it


def _child(model: str) -> dict:
    from jaxspec.cli import build_parser
    from jaxspec.sampling import SamplingParams
    from jaxspec.server import program_store as store_module
    from jaxspec.server import programs as programs_module
    from jaxspec.server.launch import build
    from jaxspec.server.scheduler import Request

    traced, saved, loaded = [], [], []
    lower = programs_module.Programs._lower
    save, load = store_module.ProgramStore.save, store_module.ProgramStore.load
    store_module.ProgramStore.save = lambda self, key, prog: saved.append(list(key)) or save(self, key, prog)  # type: ignore[method-assign]
    store_module.ProgramStore.load = lambda self, key, tree: (  # type: ignore[method-assign]
        (lambda got: (loaded.append(list(key)) if got is not None else None) or got)(load(self, key, tree))
    )
    programs_module.Programs._lower = lambda self, key: traced.append(key) or lower(self, key)  # type: ignore[method-assign]
    argv = ["serve", "--model-path", model, "--context-length", "256", "--disable-background-compile"]
    _, sched = build(build_parser().parse_args(argv), progress=False)
    progs = sched.programs
    store = progs._store
    keys = progs.startup_keys(progs.startup_bs)
    grammar = [k for k in keys if k[0] == "dispatch" and k[6]] + [k for k in keys if k[0] == "finish"]
    again = 0
    left = [progs.background_left(), len(progs.unstored)]  # background work counts the compiles for the store
    if os.environ.get("STORE_AGAIN"):
        while progs.unstored:
            before = store.saved
            progs.store_again(progs.unstored.popleft())
            again += store.saved - before
        left.append(progs.background_left())
    got = {}
    for i, ids in enumerate(PROMPTS):
        sched.submit(
            Request(
                ids=ids,
                params=SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True),
                emit=lambda e, i=i: got.__setitem__(i, e["result"]["output_ids"]) if e["type"] == "done" else None,
            )
        )
    sched.run_until_idle()
    stored = lambda k: os.path.exists(store._path(k))
    others = [k for k in keys if k not in grammar]
    return {
        "saved": sorted(saved[: len(saved) - again]),
        "stored_again": again,
        "left": left,
        "loaded": sorted(loaded),
        "traced": len([k for k in traced if k in keys]),
        "grammar": len(grammar),
        "grammar_stored": [list(k) for k in grammar if stored(k)],
        "others": len(others),
        "others_stored": sum(map(stored, others)),
        "tokens": [got[i] for i in range(len(PROMPTS))],
    }


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(HERE)]
    print(json.dumps(_child(sys.argv[1])))

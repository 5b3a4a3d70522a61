"""The persistent compilation cache: on by default under the jaxspec cache directory, moved or
turned off by JAXSPEC_COMPILATION_CACHE, and actually reused by a second process."""

from __future__ import annotations

import os
import subprocess
import sys

PROG = """
import jax, jax.numpy as jnp
from jax._src import monitoring
from jaxspec import compile_cache
monitoring.register_event_listener(lambda event, **kw: print("event", event) if "cache_hit" in event else None)
print("dir", compile_cache.enable())
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
f(jnp.ones((64, 64))).block_until_ready()
"""


def run(env) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", PROG], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def test_default_location_and_reuse(tmp_path):
    env = {"JAXSPEC_CACHE_DIR": str(tmp_path), "JAXSPEC_COMPILATION_CACHE": ""}
    out = run(env)
    where = tmp_path / "xla"
    assert f"dir {where}" in out
    entries = sorted(os.listdir(where))
    assert entries, "nothing was written to the cache"
    assert "cache_hit" not in out
    out = run(env)
    assert "cache_hit" in out, out  # the second process loads the program instead of compiling it
    assert sorted(os.listdir(where)) == entries


def test_moved_and_off(tmp_path):
    assert f"dir {tmp_path / 'elsewhere'}" in run({"JAXSPEC_COMPILATION_CACHE": str(tmp_path / "elsewhere")})
    assert os.listdir(tmp_path / "elsewhere")
    assert "dir None" in run({"JAXSPEC_COMPILATION_CACHE": "off", "JAXSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert not (tmp_path / "c").exists()

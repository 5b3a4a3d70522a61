"""JAX's persistent compilation cache under the jaxspec cache directory, on by default.

Every `jaxspec serve` / `jaxspec generate` / Engine compiles the same XLA programs; with the cache a
second start loads them from disk instead of compiling (on the 2-core CPU: minutes of compiling
become seconds). Where it lives, by precedence:

  JAXSPEC_COMPILATION_CACHE=off          no persistent cache (also: 0, false, none)
  JAXSPEC_COMPILATION_CACHE=/some/dir    that directory
  JAX_COMPILATION_CACHE_DIR / jax.config  the user's own JAX setting is left alone
  (default)                               $JAXSPEC_CACHE_DIR/xla (default ~/.cache/jaxspec/xla)
"""

from __future__ import annotations

import logging
import os

import jax

from jaxspec.paths import cache_dir

logger = logging.getLogger("jaxspec")

ENV = "JAXSPEC_COMPILATION_CACHE"
OFF = ("off", "0", "false", "none", "no")


def cache_path() -> str | None:
    """The directory jaxspec will use (None: off, or the user's own JAX setting wins)."""
    v = os.environ.get(ENV)
    if v is not None and v.strip().lower() in OFF:
        return None
    if v:
        return os.path.expanduser(v)
    if _jax_cache_dir():
        return None
    return os.path.join(cache_dir(), "xla")


def _jax_cache_dir() -> str | None:
    """JAX's own persistent-cache setting (a config flag that its type stubs do not declare)."""
    return jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]


def enable() -> str | None:
    """Points JAX's persistent cache at cache_path() (idempotent); returns the directory in use."""
    path = cache_path()
    if path is None:  # off, or the user's own JAX setting
        return None if os.environ.get(ENV, "").strip().lower() in OFF else _jax_cache_dir()
    if _jax_cache_dir() != path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            logger.warning(
                "compilation cache disabled: cannot create %s (%s); set %s=off or another directory", path, e, ENV
            )
            return None
        jax.config.update("jax_compilation_cache_dir", path)
        # cache every program: small ones add up (a one-line `jaxspec generate` compiles dozens)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        logger.info("persistent compilation cache: %s", path)
    return path

"""The native XLA:CPU int8 kernel (jaxspec/native): exact against an integer reference for 1 to 13 rows
(several passes of 8), ragged sizes and the extreme values; built once and cached; switched off
cleanly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import native

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU kernel")


@pytest.fixture(scope="module")
def kernel():
    if not native.available():
        pytest.skip("no C++ compiler here: the engine uses XLA's int8 dot")


@pytest.mark.parametrize("rows,din,dout", [(1, 576, 960), (2, 64, 5), (3, 577, 33), (8, 130, 1000), (13, 1536, 300)])
def test_int8_matmul_is_exact(kernel, rows, din, dout):
    rng = np.random.default_rng(rows * 1000 + din)
    x = rng.integers(-127, 128, (rows, din)).astype(np.int8)
    w = rng.integers(-127, 128, (dout, din)).astype(np.int8)
    x[0] = -127
    w[0] = -127  # the largest sums: 127 * 127 * din
    got = np.asarray(jax.jit(native.int8_matmul)(jnp.asarray(x), jnp.asarray(w)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, x.astype(np.int32) @ w.T.astype(np.int32))  # exact integer reference


def test_built_once_and_switched_off(kernel, monkeypatch, tmp_path):
    """The library is cached by source, CPU and jax version; JAXSPEC_NATIVE_KERNELS=0 turns it off, and a
    failing build is a warning, not an error."""
    assert native._build() == native._build()
    native.available.cache_clear()
    try:
        monkeypatch.setenv(native.ENV, "0")
        assert not native.available()
        native.available.cache_clear()
        monkeypatch.delenv(native.ENV)
        monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(native, "_compiler", lambda: None)
        logs = []
        monkeypatch.setattr(native.logger, "warning", lambda msg, *a: logs.append(msg % a))
        assert not native.available()
        assert "no C++ compiler" in logs[0] and "XLA's int8 dot" in logs[0]
    finally:
        native.available.cache_clear()
        monkeypatch.undo()
        assert native.available()

"""The native CPU attention kernel (jaxspec/native/attention.cc): right against the jnp reference, and a
row's output bitwise independent of the buffer's length, of the other rows of the call and of where its
visible columns sit, which is what keeps greedy speculation token-identical to plain decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import attention as attn
from jaxspec import native
from jaxspec.pallas_kernels.tree_attention import tree_attention_reference

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or native.attention_unavailable() is not None,
    reason="the native attention kernel runs on XLA:CPU",
)

B, H, HKV, D = 2, 9, 3, 64  # SmolLM2's heads


def _data(s, t, seed=0, d=D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, H, d)).astype(np.float32)
    k = rng.standard_normal((B, s, HKV, d)).astype(np.float32)
    v = rng.standard_normal((B, s, HKV, d)).astype(np.float32)
    return q, k, v


def _native(q, k, v, kv_len, offset=0, mask=None, window=None):
    f = jax.jit(lambda q, k, v, kv_len, offset, mask: native.attention(q, k, v, kv_len, offset, mask, window))
    return np.asarray(f(q, k, v, jnp.asarray(kv_len, jnp.int32), jnp.int32(offset), mask))


@pytest.mark.parametrize("offset,window", [(0, None), (3, None), (0, 40), (2, 17)])
def test_causal_rows_match_the_reference(offset, window):
    q, k, v = _data(256, 5)
    kv_len = np.array([0, 180])
    out = _native(q, k, v, kv_len, offset, None, window)
    ref = tree_attention_reference(q, k, v, jnp.asarray(kv_len), None, offset=offset, sliding_window=window)
    np.testing.assert_allclose(out, np.asarray(ref), atol=2e-6, rtol=0)


@pytest.mark.parametrize("d", [128, 20])
def test_other_head_sizes_match_the_reference(d):
    """128: two passes of 64 over the values; 20 (not a multiple of 8): the scalar path."""
    q, k, v = _data(96, 3, seed=4, d=d)
    kv_len = np.array([0, 61])
    out = _native(q, k, v, kv_len)
    ref = tree_attention_reference(q, k, v, jnp.asarray(kv_len), None)
    np.testing.assert_allclose(out, np.asarray(ref), atol=2e-6, rtol=0)


def test_tree_rows_match_the_reference():
    q, k, v = _data(128, 6)
    rng = np.random.default_rng(1)
    mask = (rng.random((B, 6, 6)) < 0.5) | np.eye(6, dtype=bool)
    kv_len = np.array([7, 100])
    out = _native(q, k, v, kv_len, 0, jnp.asarray(mask))
    ref = tree_attention_reference(q, k, v, jnp.asarray(kv_len), jnp.asarray(mask))
    np.testing.assert_allclose(out, np.asarray(ref), atol=2e-6, rtol=0)


@pytest.mark.parametrize("kv_len", [0, 5, 63, 64, 100, 700])
def test_a_row_is_bitwise_the_same_in_any_buffer_and_batch(kv_len):
    """One query row over the same visible keys and values: buffers of 64 to 2100 columns (zeros
    past the row), alone or among 4 rows, give the same bits."""
    q, k, v = _data(2100, 4, seed=kv_len)
    outs = []
    for s in (64, 256, 1024, 2048, 2100):
        if kv_len + 4 > s:
            continue
        ks, vs = np.zeros_like(k[:, :s]), np.zeros_like(v[:, :s])
        ks[:, : kv_len + 4], vs[:, : kv_len + 4] = k[:, : kv_len + 4], v[:, : kv_len + 4]
        for t in (1, 4):
            outs.append(_native(q[:, :t], ks, vs, [kv_len] * B)[:, 0])
    assert len(outs) >= 2 and all(np.array_equal(o, outs[0]) for o in outs)


def test_a_tree_row_equals_the_plain_row_of_its_path():
    """Verification sees a node's ancestors at their tree columns; plain decoding, after those tokens
    were accepted, at consecutive columns. Same keys, values and query: same bits."""
    q, k, v = _data(512, 6, seed=3)
    kv_len, path = 200, [0, 2, 5]  # node 5's ancestors (and itself) in a 6-node tree
    mask = np.zeros((B, 6, 6), bool)
    mask[:, 5, path] = True
    for i in range(5):
        mask[:, i, i] = True
    tree = _native(q, k, v, [kv_len] * B, 0, jnp.asarray(mask))[:, 5]
    ks, vs = k.copy(), v.copy()
    for j, node in enumerate(path):  # the accepted path written back consecutively
        ks[:, kv_len + j], vs[:, kv_len + j] = k[:, kv_len + node], v[:, kv_len + node]
    plain = _native(q[:, 5:6], ks[:, :1024], vs[:, :1024], [kv_len + 2] * B)[:, 0]
    assert np.array_equal(tree, plain)


def test_the_xla_backend_takes_the_kernel_for_few_float32_rows():
    q, k, v = _data(64, 2)
    assert attn.native_rows(jnp.asarray(q), jnp.asarray(k))
    assert not attn.native_rows(jnp.zeros((B, attn.NATIVE_ROWS + 1, H, D)), jnp.asarray(k))
    assert not attn.native_rows(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16))
    out = attn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([3, 30]), backend="xla")
    assert np.array_equal(np.asarray(out), _native(q, k, v, [3, 30]))
    mask = jnp.asarray(np.tril(np.ones((B, 2, 2), bool)))  # verification in decode mode: the same kernel
    out = attn.attention(*map(jnp.asarray, (q, k, v)), jnp.asarray([3, 30]), mask, backend="xla:decode")
    assert np.array_equal(np.asarray(out), _native(q, k, v, [3, 30], 0, mask))


def test_the_xla_backend_is_differentiable_through_the_kernel():
    """Draft training differentiates heads whose attention the xla backend sends to the kernel: the
    gradient is the reference attention's."""
    q, k, v = _data(64, 5)
    kv_len = jnp.asarray([3, 40], jnp.int32)
    assert attn.native_rows(jnp.asarray(q), jnp.asarray(k))
    w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape).astype(np.float32))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    got = jax.grad(loss(lambda q, k, v: attn.attention(q, k, v, kv_len, offset=1)), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: attn.attention_reference(q, k, v, kv_len, offset=1)), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)

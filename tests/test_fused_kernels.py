"""The GPU path's fused kernels against their jnp references, in Pallas interpret mode on the CPU
(the same kernel bodies a GPU compiles): few-row projections with their norm / activation /
residual folded in, the q/k/v projection with RoPE and the KV write, and the accepted path's KV
moved in every layer at once. Then a decoder layer run fused against the unfused layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels.kv_commit import commit, commit_reference
from jaxspec.pallas_kernels.rows_matmul import (
    qkv_rope_write,
    qkv_rope_write_reference,
    rows_matmul,
    rows_matmul_reference,
)

RNG = np.random.default_rng(0)


def arr(*shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale, dtype)


def close(a, b, tol):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) <= tol


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("prologue", [None, "rmsnorm", "swiglu"])
def test_rows_matmul_matches_reference(m, prologue):
    k, n = 128, 192
    x = arr(m, 2 * k if prologue == "swiglu" else k)
    w, nw, bias, res = arr(k, n, scale=0.1), arr(k), arr(n), arr(m, n)
    norm_w = nw if prologue == "rmsnorm" else None
    out = rows_matmul(x, w, norm_w, bias, res, prologue=prologue, eps=1e-5, interpret=True)
    ref = rows_matmul_reference(x, w, prologue=prologue, norm_w=norm_w, eps=1e-5, bias=bias, residual=res)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert close(out, ref, 0.07)  # a bf16 rounding step or two at |y| ~ 5


def test_rows_matmul_row_does_not_depend_on_the_other_rows():
    """A token's projection alone equals its projection among the rows of a tree (float32: exact)."""
    x, w = arr(8, 64, dtype=jnp.float32), arr(64, 128, dtype=jnp.float32)
    together = rows_matmul(x, w, interpret=True)
    for i in (0, 5):
        assert bool(jnp.all(rows_matmul(x[i : i + 1], w, interpret=True) == together[i : i + 1]))


def test_rows_matmul_refuses_shapes_it_does_not_cover():
    with pytest.raises(ValueError, match="unsupported"):
        rows_matmul(arr(3, 64), arr(64, 64), interpret=True)  # 3 rows: not a power of two


@pytest.mark.parametrize("m", [1, 8])
def test_qkv_rope_write_matches_reference(m):
    nh, nkv, d, k, b, s = 4, 2, 32, 128, 2, 32
    x, w, nw, bias = arr(m, k), arr(k, (nh + 2 * nkv) * d, scale=0.1), arr(k), arr((nh + 2 * nkv) * d)
    pos = jnp.asarray(RNG.integers(0, 200, m), jnp.int32)
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2) / d))
    kc, vc = arr(b, s, nkv, d), arr(b, s, nkv, d)
    slot = jnp.asarray(RNG.integers(0, b, m), jnp.int32)
    col = jnp.asarray(RNG.permutation(s)[:m], jnp.int32)
    if m > 1:
        col = col.at[-1].set(s + 3)  # past the end: dropped, as the scatter drops it
    ref = qkv_rope_write_reference(x, w, nw, bias, pos, inv_freq, kc, vc, slot, col, nh=nh, nkv=nkv, eps=1e-5)
    out = qkv_rope_write(
        x, w, nw, bias, pos, inv_freq, kc + 0, vc + 0, slot, col, nh=nh, nkv=nkv, eps=1e-5, interpret=True
    )
    for o, r in zip(out, ref):
        assert o.shape == r.shape and close(o, r, 0.07)
    untouched = jnp.ones((b, s), bool).at[slot, jnp.minimum(col, s - 1)].set(False)
    assert bool(jnp.all(jnp.where(untouched[:, :, None, None], out[1] == kc, True)))


def test_kv_commit_moves_every_layer_like_gather_then_scatter():
    bufs = tuple(arr(3, 32, 2, 16) for _ in range(4))
    slots = jnp.asarray([2, 0], jnp.int32)
    lengths = jnp.asarray([5, 24], jnp.int32)
    path = jnp.asarray([[0, 2, 3, 7, 1, 4], [0, 1, 5, 2, 3, 6]], jnp.int32)  # overlapping sources and targets
    src, dst = lengths[:, None] + path, lengths[:, None] + jnp.arange(6)[None]
    ref = commit_reference(bufs, slots, src, dst)
    out = commit(tuple(x + 0 for x in bufs), slots, src, dst, interpret=True)
    assert all(bool(jnp.all(o == r)) for o, r in zip(out, ref))


def test_decoder_layer_fused_matches_unfused():
    """A tiny layer on the pallas backend runs the fused kernels (fused_layer.applies) and gives the
    unfused layer's output and cache, up to float rounding."""
    from flax import nnx

    from jaxspec.cache import KVCache
    from jaxspec.config import ModelConfig, rope_inv_freq
    from jaxspec.models import fused_layer
    from jaxspec.models.llama import DecoderLayer, fuse_projections

    cfg = ModelConfig("llama", 97, 64, 128, 1, 4, 2, 16, 1e-5, 10000.0)
    layer = fuse_projections(DecoderLayer(cfg, jnp.float32, nnx.Rngs(0)))
    b, t = 2, 4
    x = arr(b, t, 64, dtype=jnp.float32)
    cache = KVCache.create(cfg, b, 32, jnp.float32)
    cache = cache.__class__(cache.k, cache.v, jnp.asarray([3, 9], jnp.int32))
    pos = cache.lengths[:, None] + jnp.arange(t)[None]
    inv = jnp.asarray(rope_inv_freq(cfg))
    assert fused_layer.applies(layer, b * t, "pallas", cache)
    assert not fused_layer.applies(layer, b * t, "xla", cache) and not fused_layer.applies(layer, 3, "pallas", cache)
    with jax.default_matmul_precision("highest"):
        y_ref, c_ref = layer(x, pos, inv, cache, 0, None, 0, "xla")
        y, c = jax.jit(lambda x, c: layer(x, pos, inv, c, 0, None, 0, "pallas"))(x, cache)
    assert close(y, y_ref, 1e-4)
    assert close(c.k[0], c_ref.k[0], 1e-4) and close(c.v[0], c_ref.v[0], 1e-4)


def test_eagle3_head_fused_matches_unfused():
    """An EAGLE-3 head on the pallas backend runs its layer fused (fc, q/k/v with RoPE and the KV
    write, o, gate/up, down as kernels) and gives the unfused head's outputs and cache."""
    from flax import nnx

    from jaxspec.cache import KVCache
    from jaxspec.config import ModelConfig
    from jaxspec.models import fused_layer
    from jaxspec.models.eagle import Eagle3Head
    from jaxspec.models.llama import fuse_projections

    cfg = ModelConfig("llama", 97, 64, 128, 1, 4, 2, 16, 1e-5, 10000.0)
    head = fuse_projections(Eagle3Head(cfg, 32, jnp.float32, rngs=nnx.Rngs(0)))
    b, t = 2, 4
    embeds = arr(b, t, 64, dtype=jnp.float32)
    cache = KVCache.create(cfg, b, 32, jnp.float32)
    cache = cache.__class__(cache.k, cache.v, jnp.asarray([3, 9], jnp.int32))
    pos = cache.lengths[:, None] + jnp.arange(t)[None]
    assert fused_layer.eagle3_applies(head, b * t, "pallas", cache)
    for width in (3 * 64, 64):  # target features, then a fed-back hidden state
        hidden = arr(b, t, width, dtype=jnp.float32)
        with jax.default_matmul_precision("highest"):
            ref = head(embeds, hidden, pos, cache, backend="xla")
            out = jax.jit(lambda e, h, c: head(e, h, pos, c, backend="pallas"))(embeds, hidden, cache)
        for o, r in zip(out[:2], ref[:2]):
            assert close(o, r, 1e-4)
        assert close(out[2].k[0], ref[2].k[0], 1e-4) and close(out[2].v[0], ref[2].v[0], 1e-4)

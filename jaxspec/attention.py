"""Attention over a per-slot KV cache with a compact mask description: one entry point, two backends.

Query rows are T new tokens per slot whose KV was just written at cache columns
prefix_len[b] + offset + t. Visibility of cache column c for query row t:
  c < prefix_len[b]                         -> visible (the committed prefix)
  prefix_len[b] <= c < prefix_len[b] + W    -> local_mask[b, t, c - prefix_len[b]]  (the local region)
  otherwise                                 -> hidden
`local_mask=None` means causal: W = offset + T and row t sees the region up to its own column.
A verification tree passes its ancestor mask [B, N, N]; a draft tree step passes [B, k, W] over all
draft-tree tokens so far — never a dense [B, N, S] mask.

Backends:
  "xla"     the pure-jnp reference (`pallas_kernels.tree_attention.tree_attention_reference`); any
            shape; the CPU default and the fallback.
  "pallas"  the Pallas GPU kernels: `decode_attention` for one causal query per slot, `tree_attention`
            for everything else (verification trees, draft beams, prefill chunks). Off the GPU they
            run in Pallas interpret mode (slow; for tests). Shapes the kernels do not handle (head_dim
            not a power of two, cache length not a multiple of 16) fall back to "xla" with a warning.
`default_backend()` picks "pallas" on a GPU whose kernels pass a start-up self-check (compiled and
compared with the reference on small shapes), and "xla" elsewhere or if the check fails (logged).

Tensor parallel (`kv_sharding`: the cache is split on its KV-head axis, jaxspec/sharding.py): XLA
cannot partition a Pallas call, so the kernels run under `jax.shard_map`, each device on its own
query and KV heads (GQA groups never straddle devices). The xla backend needs nothing: the
partitioner splits the einsums itself.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import decode_attention as _decode
from pallas_kernels import tree_attention as _tree

BACKENDS = ("xla", "pallas")
attention_reference = _tree.tree_attention_reference
logger = logging.getLogger(__name__)


def default_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" and pallas_self_check() is None else "xla"


@functools.cache
def pallas_self_check() -> str | None:
    """Runs both kernels once on small random inputs (bf16, GQA 4, a tree mask, ragged lengths) and
    compares with the reference. Returns None if they agree, else what went wrong (logged)."""
    import numpy as np

    try:
        rng = np.random.default_rng(0)
        b, t, hkv, g, d, s = 2, 8, 2, 4, 128, 256
        q, k, v = (
            jnp.asarray(rng.standard_normal(x), jnp.bfloat16)
            for x in ((b, t, hkv * g, d), (b, s, hkv, d), (b, s, hkv, d))
        )
        kv_len = jnp.asarray([3, 200], jnp.int32)
        mask = jnp.asarray(rng.random((b, t, t)) < 0.5) | jnp.eye(t, dtype=bool)
        interpret = jax.default_backend() != "gpu"
        pairs = [
            (
                _tree.tree_attention(q, k, v, kv_len, mask, interpret=interpret),
                attention_reference(q, k, v, kv_len, mask),
            ),
            (
                _decode.decode_attention(q[:, 0], k, v, kv_len, interpret=interpret),
                _decode.decode_attention_reference(q[:, 0], k, v, kv_len),
            ),
        ]
        err = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32)))) for o, r in pairs)
        problem = None if err < 5e-2 else f"max abs error {err:.3g} against the reference"
    except Exception as e:  # a lowering/compile failure on this GPU or JAX version
        problem = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    if problem:
        logger.warning("pallas attention kernels failed their self-check (%s); using the xla backend", problem)
    return problem


def resolve_backend(backend: str | None) -> str:
    """None/"auto" -> the platform default; otherwise checked against BACKENDS (ValueError)."""
    if backend in (None, "auto"):
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}")
    return backend


def attention(
    q, k, v, prefix_len, local_mask=None, sliding_window=None, offset=0, backend: str = "xla", kv_sharding=None
):
    """q: [B, T, H, D]; k, v: [B, S, Hkv, D]; prefix_len: [B] int32; local_mask: [B, T, W] bool or None;
    kv_sharding: the NamedSharding of k and v when they are split over devices (None: one device).
    Returns [B, T, H, D] in q.dtype."""
    if backend == "pallas":
        reason = _tree.supported(q, k)
        if reason is None:
            if kv_sharding is None:
                return _pallas(q, k, v, prefix_len, offset, local_mask, sliding_window=sliding_window)
            return _pallas_sharded(kv_sharding, q, k, v, prefix_len, offset, local_mask, sliding_window)
        _warn_fallback(reason)
    elif backend != "xla":
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}")
    return attention_reference(q, k, v, prefix_len, local_mask, offset=offset, sliding_window=sliding_window)


def _pallas(q, k, v, prefix_len, offset, local_mask=None, *, sliding_window):
    interpret = jax.default_backend() != "gpu"
    if q.shape[1] == 1 and local_mask is None:
        out = _decode.decode_attention(
            q[:, 0], k, v, prefix_len + offset + 1, sliding_window=sliding_window, interpret=interpret
        )
        return out[:, None]
    return _tree.tree_attention(
        q, k, v, prefix_len, local_mask, offset=offset, sliding_window=sliding_window, interpret=interpret
    )


def _pallas_sharded(kv_sharding, q, k, v, prefix_len, offset, local_mask, sliding_window):
    """The kernels per device on its heads: q [B, T, H, D] and k, v split on axis 2 as kv_sharding says."""
    heads = P(None, None, kv_sharding.spec[2])
    args = [q, k, v, prefix_len, jnp.asarray(offset, jnp.int32)] + ([] if local_mask is None else [local_mask])
    specs = (heads, heads, heads, P(), P()) + (() if local_mask is None else (P(),))
    body = functools.partial(_pallas, sliding_window=sliding_window)
    return jax.shard_map(body, mesh=kv_sharding.mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)


@functools.cache
def _warn_fallback(reason: str):
    logger.warning("attention backend pallas: %s; using xla for these shapes", reason)

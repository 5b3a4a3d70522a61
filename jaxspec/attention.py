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
  "xla"     the pure-jnp reference (`jaxspec.pallas_kernels.tree_attention.tree_attention_reference`); any
            shape; the CPU default and the fallback. On a CPU, calls of at most NATIVE_ROWS rows per slot
            over a float32 cache (decoding steps, verification trees, draft steps) run the native
            kernel instead (`jaxspec.native.attention`, built on first use; JAXSPEC_NATIVE_KERNELS=0
            keeps the reference): a row's output there is bitwise the same whatever the buffer's
            length and the other rows of the call, so a verification pass computes a token's logits
            exactly as the plain decoding step does, and it reads only the columns a row sees (so it
            serves the "decode" mode below too).
  "pallas"  the Pallas GPU kernels: `decode_attention` for one causal query per slot, `tree_attention`
            for everything else (verification trees, draft beams, prefill chunks). Off the GPU they
            run in Pallas interpret mode (slow; for tests). Shapes the kernels do not handle (head_dim
            not a power of two, cache length not a multiple of 16) fall back to "xla" with a warning.
Modes (SGLang's --speculative-attention-mode, for target verification and the draft's extend):
  "prefill"  (default) the one path above: the new rows go through the tree kernel (or the reference)
             with the prefix and the local region in the same pass, as prefill chunks do.
  "decode"   split attention: the committed prefix is read by the decode path with all T new rows
             folded into the GQA group (every row sees the same prefix, so it needs no mask at all:
             `decode_attention` with T * G query rows per KV head), the local region by a small dense
             masked attention over its W columns, and the two are merged by their log-sum-exps. Same
             result up to float rounding. A mode is chosen by suffixing the backend: "pallas:decode"
             (`with_mode`); rows the split does not serve (one causal row: plain decode already is
             the decode path; a sliding window; a traced offset) run the one path.
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

from jaxspec import compile_target, native
from jaxspec.pallas_kernels import decode_attention as _decode
from jaxspec.pallas_kernels import kv_commit as _commit
from jaxspec.pallas_kernels import rows_matmul as _rows
from jaxspec.pallas_kernels import tree_attention as _tree

BACKENDS = ("xla", "pallas")
NATIVE_ROWS = 64  # rows per slot up to which the xla backend runs the native kernel on a CPU
MODES = ("prefill", "decode")
attention_reference = _tree.tree_attention_reference
logger = logging.getLogger(__name__)


def default_backend() -> str:
    if compile_target.platform() != "gpu":
        return "xla"
    # compiling for a GPU this process does not have: nothing can run the check, the kernels are taken
    return "pallas" if compile_target.deviceless() or pallas_self_check() is None else "xla"


@functools.cache
def pallas_self_check() -> str | None:
    """Runs the GPU path's kernels once on small random inputs and compares each with its reference:
    both attention kernels (bf16, GQA 4, a tree mask, ragged lengths), and the fused layer's
    projection, q/k/v (RoPE, KV write) and KV commit kernels (jaxspec/models/fused_layer.py). Returns
    None if they agree, else what went wrong (logged): then none of them is used."""
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
        interpret = compile_target.platform() != "gpu"
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
        pairs += _fused_pairs(rng, interpret)
        err = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32)))) for o, r in pairs)
        problem = None if err < 5e-2 else f"max abs error {err:.3g} against the reference"
    except Exception as e:  # a lowering/compile failure on this GPU or JAX version
        problem = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    if problem:
        logger.warning("pallas kernels failed their self-check (%s); using the xla backend", problem)
    return problem


def _fused_pairs(rng, interpret: bool) -> list:
    """(kernel output, reference) pairs of the fused layer's kernels on small bf16 inputs (|y| ~ 1)."""
    m, k, nh, nkv, d = 4, 64, 4, 2, 32
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, (nh + 2 * nkv) * d)) * 0.1, jnp.bfloat16)
    nw = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
    pairs = [
        (
            _rows.rows_matmul(x, w, nw, prologue="rmsnorm", eps=1e-5, interpret=interpret),
            _rows.rows_matmul_reference(x, w, prologue="rmsnorm", norm_w=nw, eps=1e-5),
        )
    ]
    cache = jnp.asarray(rng.standard_normal((2, 32, nkv, d)), jnp.bfloat16)
    pos, slot, col = jnp.asarray([3, 9, 17, 30], jnp.int32), jnp.asarray([0, 1, 0, 1], jnp.int32), jnp.arange(4)
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2) / d))
    args = (x, w, nw, None, pos, inv_freq)
    out = _rows.qkv_rope_write(*args, cache + 0, cache + 1, slot, col, nh=nh, nkv=nkv, eps=1e-5, interpret=interpret)
    ref = _rows.qkv_rope_write_reference(*args, cache, cache + 1, slot, col, nh=nh, nkv=nkv, eps=1e-5)
    pairs += list(zip(out, ref))
    src, dst = jnp.asarray([[5, 7, 6]]), jnp.asarray([[5, 6, 7]])
    moved = _commit.commit((cache + 0,), jnp.asarray([1]), src, dst, interpret=interpret)
    pairs.append((moved[0], _commit.commit_reference((cache,), jnp.asarray([1]), src, dst)[0]))
    return pairs


def whole_buffers(backend: str, cache) -> bool:
    """Whether attention on `backend` reads `cache`'s full buffers rather than its view's slice
    (KVCache.read): the Pallas kernels in their one path on one device, which index slots and stop
    at each slot's length themselves."""
    return backend == "pallas" and cache.sharding is None


def resolve_backend(backend: str | None) -> str:
    """None/"auto" -> the platform default; otherwise checked against BACKENDS (ValueError)."""
    if backend in (None, "auto"):
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}")
    return backend


def with_mode(backend: str, mode: str) -> str:
    """The backend string of attention mode `mode` (MODES) on `backend`: "pallas" + "decode" ->
    "pallas:decode"; the prefill mode is the backend itself."""
    if mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}; available: {', '.join(MODES)}")
    return backend.partition(":")[0] + ("" if mode == "prefill" else f":{mode}")


def attention(
    q, k, v, prefix_len, local_mask=None, sliding_window=None, offset=0, backend: str = "xla", kv_sharding=None
):
    """q: [B, T, H, D]; k, v: [B, S, Hkv, D]; prefix_len: [B] int32; local_mask: [B, T, W] bool or None;
    backend: a BACKENDS name, optionally with a mode (`with_mode`); kv_sharding: the NamedSharding of
    k and v when they are split over devices (None: one device). Returns [B, T, H, D] in q.dtype."""
    backend, _, mode = backend.partition(":")
    if mode not in ("", "prefill", "decode"):
        raise ValueError(f"unknown attention mode {mode!r}; available: {', '.join(MODES)}")
    if backend == "xla" and native_rows(q, k, kv_sharding):  # every mode: it reads only what a row sees
        return _native(q, k, v, prefix_len, offset, local_mask, sliding_window).astype(q.dtype)
    if mode == "decode" and not (q.shape[1] == 1 and local_mask is None):
        reason = _split_unsupported(sliding_window, offset, local_mask)
        if reason is None:
            return split_attention(q, k, v, prefix_len, local_mask, offset, backend, kv_sharding)
        _warn_split(reason)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _native(q, k, v, prefix_len, offset, local_mask, sliding_window):
    """The native kernel, differentiable (draft training runs heads through this module): the
    gradient is the reference attention's, which computes the same function."""
    return native.attention(q, k, v, prefix_len, offset, local_mask, sliding_window)


def _native_fwd(q, k, v, prefix_len, offset, local_mask, sliding_window):
    return _native(q, k, v, prefix_len, offset, local_mask, sliding_window), (q, k, v, prefix_len, offset, local_mask)


def _native_bwd(sliding_window, res, g):
    q, k, v, prefix_len, offset, local_mask = res
    ref = lambda q, k, v: attention_reference(
        q, k, v, prefix_len, local_mask, offset=offset, sliding_window=sliding_window
    )
    return (*jax.vjp(ref, q, k, v)[1](g.astype(q.dtype)), None, None, None)


_native.defvjp(_native_fwd, _native_bwd)


def native_rows(q, k, kv_sharding=None) -> bool:
    """Whether the xla backend runs these rows through the native CPU kernel: a float32 cache on
    one device, at most NATIVE_ROWS rows per slot, and the kernel built (on a CPU, not disabled)."""
    if kv_sharding is not None or q.shape[1] > NATIVE_ROWS or k.dtype != jnp.float32 or q.dtype != jnp.float32:
        return False
    why = native.attention_unavailable()
    if why is not None and native.enabled():
        _warn_native(why)
    return why is None


@functools.cache
def _warn_native(reason: str):
    logger.warning("native attention kernel unavailable (%s); attention runs in XLA", reason)


def _pallas(q, k, v, prefix_len, offset, local_mask=None, *, sliding_window):
    interpret = compile_target.platform() != "gpu"
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


# ---- decode mode: the prefix through the decode path, the local region apart, merged ------------


def _split_unsupported(sliding_window, offset, local_mask) -> str | None:
    if sliding_window is not None:
        return "a sliding window limits each row's prefix differently"
    if local_mask is None and not isinstance(offset, int):
        return "a causal region at a traced offset has no static width"
    return None


@functools.cache
def _warn_split(reason: str):
    logger.info("attention mode decode: %s; these calls run the prefill-mode path", reason)


def split_attention(q, k, v, prefix_len, local_mask, offset, backend, kv_sharding=None):
    """Decode-mode attention. q: [B, T, H, D]; k, v: [B, S, Hkv, D]; prefix_len: [B] int32;
    local_mask: [B, T, W] bool, or None for causal rows at a static offset (W = offset + T).

    Prefix: columns [0, prefix_len) seen by every row, through the decode kernel (or its reference)
    with the T rows folded into the GQA group. Local: columns prefix_len + [0, W) through the mask,
    gathered and attended densely. Each part returns its rows' log-sum-exp; the weighted sum is the
    softmax over both. Returns [B, T, H, D] in q.dtype."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    if local_mask is None:  # causal: row t sees region columns [0, offset + t]
        w = offset + t
        local_mask = jnp.broadcast_to(jnp.arange(w)[None, :] <= offset + jnp.arange(t)[:, None], (b, t, w))
    # [B, T, Hkv, G, D] -> [B, Hkv * T * G, D]: one decode query "head" per (row, head) pair
    qf = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv * t * g, d)
    reason = _tree.supported(q, k) if backend == "pallas" else None
    if reason is not None:
        _warn_fallback(reason)
    if backend == "pallas" and reason is None:
        if kv_sharding is None:
            o_p, lse_p = _decode.decode_attention(
                qf, k, v, prefix_len, interpret=compile_target.platform() != "gpu", return_lse=True
            )
        else:
            o_p, lse_p = _decode_sharded(kv_sharding, qf, k, v, prefix_len)
    else:
        o_p, lse_p = _decode.decode_attention_reference(qf, k, v, prefix_len, return_lse=True)
    unfold = lambda x: x.reshape(b, hkv, t, g, *x.shape[2:]).transpose(0, 2, 1, 3, *range(4, x.ndim + 2))
    o_p = unfold(o_p).reshape(b, t, h, d)  # float32
    lse_p = unfold(lse_p).reshape(b, t, h)
    o_l, lse_l = _local_attention(q, k, v, prefix_len, local_mask)
    m = jnp.maximum(lse_p, lse_l)  # lse_l is finite: a row always sees itself
    w_p, w_l = jnp.exp(lse_p - m)[..., None], jnp.exp(lse_l - m)[..., None]
    return ((o_p * w_p + o_l * w_l) / (w_p + w_l)).astype(q.dtype)


def _local_attention(q, k, v, prefix_len, local_mask):
    """The local region alone. q: [B, T, H, D]; local_mask: [B, T, W] over cache columns
    prefix_len + [0, W). Returns (out [B, T, H, D] float32, lse [B, T, H] float32)."""
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    w = local_mask.shape[2]
    cols = jnp.clip(prefix_len[:, None] + jnp.arange(w)[None, :], 0, s - 1)[:, :, None, None]  # [B, W, 1, 1]
    kl, vl = jnp.take_along_axis(k, cols, axis=1), jnp.take_along_axis(v, cols, axis=1)  # [B, W, Hkv, D]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    scores = jnp.einsum("btkgd,bwkd->btkgw", qg, kl, preferred_element_type=jnp.float32) * d**-0.5
    p, den, lse = _decode.softmax_parts(scores, local_mask[:, :, None, None, :])  # den, lse: [B, T, Hkv, G]
    out = jnp.einsum("btkgw,bwkd->btkgd", p.astype(v.dtype), vl, preferred_element_type=jnp.float32)
    return (out / den[..., None]).reshape(b, t, h, d), lse.reshape(b, t, h)


def _decode_sharded(kv_sharding, qf, k, v, prefix_len):
    """The decode kernel per device on its KV heads: qf [B, Hkv * T * G, D] is head-major, so splitting
    its axis 1 as k's axis 2 keeps each device's query rows with their KV heads."""
    axis = kv_sharding.spec[2]
    body = functools.partial(_decode.decode_attention, interpret=compile_target.platform() != "gpu", return_lse=True)
    return jax.shard_map(
        body,
        mesh=kv_sharding.mesh,
        in_specs=(P(None, axis), P(None, None, axis), P(None, None, axis), P()),
        out_specs=(P(None, axis), P(None, axis)),
        check_vma=False,
    )(qf, k, v, prefix_len)

"""Few-row projections as one kernel each: x [M, K] times a weight [K, N] for the 1-64 rows of a
decoding step, a draft step or a verification tree, with the RMSNorm before it or the SwiGLU
activation before it, and the bias and the residual after it, folded in. A Pallas GPU kernel, its
jitted wrapper and its jnp reference.

Why a kernel: XLA:GPU rewrites a matmul this small (fewer than ten million multiply-adds: every
projection of a SmolLM2-sized model at batch 1) into an elementwise product and a reduction, which
it emits as two kernels, and the RMSNorm in front of it as a third. A decoder layer then launched
about ten kernels for its four projections, 300 of a SmolLM2 step's 475, each a few microseconds of
launch for well under a microsecond of work (benchmarks/gpu/gpu_programs.py counts them). Here a
layer runs four: norm + q/k/v, o + residual, norm + gate/up, SwiGLU + down + residual.

Layout. Grid (N / block_n,): each program computes all M rows of `block_n` output columns, reading
its [K, block_n] slice of the weight once, one weight row at a time (BLOCK_K rows unrolled per loop
step), into an accumulator [M, block_n] in float32: out += x[:, i] (outer product) w[i, :]. Not a
tensor-core dot (which needs 16 rows), and no reduction whose order depends on the shape: every
output element sums its K products in index order whatever M is, so a token's projection in a
verification tree is computed exactly as its plain decoding step computes it (bitwise in the
interpreter, which the tests check; on a GPU, up to the compiler contracting a multiply-add).
Prologues (static `prologue`):
  None      x as given
  "rmsnorm" x * rsqrt(mean(x^2) + eps) * norm_w, as `RMSNorm` computes it (a first pass over x's
            row for the mean: x is small, every program reads it whole)
  "swiglu"  x is the fused gate/up output [M, 2K]: silu(x[:, :K]) * x[:, K:]
Epilogue: y = (x @ w) in the output dtype, + bias, + residual, in that order, as the unfused layers
round them. Shapes: K and N multiples of `block_k` and `block_n`, M a power of two up to 64
(jaxspec/models/fused_layer.py keeps XLA's path for the others).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PROLOGUES = (None, "rmsnorm", "swiglu")
BLOCK_N = 64
MAX_ROWS = 64


def _prologue_ref(x, prologue, norm_w, eps):
    if prologue == "rmsnorm":
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return y.astype(x.dtype) * norm_w
    if prologue == "swiglu":
        g, u = jnp.split(x, 2, axis=-1)
        return jax.nn.silu(g) * u
    return x


def rows_matmul_reference(x, w, *, prologue=None, norm_w=None, eps=1e-6, bias=None, residual=None):
    """Pure jnp. x [M, K] (swiglu: [M, 2K]); w [K, N]; norm_w [K]; bias [N]; residual [M, N].
    Returns [M, N] in x's dtype."""
    y = _prologue_ref(x, prologue, norm_w, eps) @ w
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def supported(m: int, k: int, n: int, block_k: int, block_n: int = BLOCK_N) -> bool:
    """Whether the kernel takes these shapes (M rows, K inputs, N outputs)."""
    return 1 <= m <= MAX_ROWS and m & (m - 1) == 0 and k % block_k == 0 and n % block_n == 0


BLOCK_K = 16


def default_block_k(m: int, k: int) -> int:
    """Weight rows per loop step (unrolled): BLOCK_K whatever M, so that a row's sum runs in the same
    steps alone and among other rows."""
    del m, k
    return BLOCK_K


@functools.partial(jax.jit, static_argnames=("prologue", "eps", "block_k", "block_n", "interpret", "num_warps"))
def rows_matmul(
    x,
    w,
    norm_w=None,
    bias=None,
    residual=None,
    *,
    prologue: str | None = None,
    eps: float = 1e-6,
    block_k: int | None = None,
    block_n: int = BLOCK_N,
    interpret: bool = False,
    num_warps: int | None = None,
):
    """x [M, K] (swiglu: [M, 2K]); w [K, N]; norm_w [K] (rmsnorm); bias [N]; residual [M, N] ->
    [M, N] in x's dtype, as rows_matmul_reference computes it (float32 accumulation)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"unknown prologue {prologue!r}; available: {PROLOGUES}")
    m = x.shape[0]
    k, n = w.shape
    block_k = block_k or default_block_k(m, k)
    if not supported(m, k, n, block_k, block_n):
        raise ValueError(f"rows_matmul: unsupported shapes M={m} K={k} N={n} (block_k {block_k}, block_n {block_n})")
    inputs = [x, w]
    in_specs = [
        pl.BlockSpec(x.shape, lambda j: (0, 0)),
        pl.BlockSpec((k, block_n), lambda j: (0, j)),
    ]
    for arr, spec in (
        (norm_w, pl.BlockSpec((k,), lambda j: (0,))),
        (bias, pl.BlockSpec((block_n,), lambda j: (j,))),
        (residual, pl.BlockSpec((m, block_n), lambda j: (0, j))),
    ):
        if arr is not None:
            inputs.append(arr)
            in_specs.append(spec)
    kernel = functools.partial(
        _kernel,
        prologue=prologue,
        eps=eps,
        k=k,
        block_k=block_k,
        has_norm=norm_w is not None,
        has_bias=bias is not None,
        has_residual=residual is not None,
    )
    return pl.pallas_call(
        kernel,
        grid=(n // block_n,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((m, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=_compiler_params(num_warps or _warps(m)),
        interpret=interpret,
        name=f"rows_matmul_{prologue or 'plain'}",
    )(*inputs)


def _kernel(*refs, prologue, eps, k, block_k, has_norm, has_bias, has_residual):
    x_ref, w_ref, *rest = refs
    o_ref = rest[-1]
    rest = list(rest[:-1])
    nw_ref = rest.pop(0) if has_norm else None
    b_ref = rest.pop(0) if has_bias else None
    r_ref = rest.pop(0) if has_residual else None
    m, block_n = o_ref.shape
    dtype = x_ref.dtype
    scale = _rms_scale(x_ref, k, block_k, eps) if prologue == "rmsnorm" else None

    def column(i):  # column i of the prologue's output: [M, 1]
        if prologue == "swiglu":
            g = x_ref[:, pl.ds(i, 1)].astype(jnp.float32)
            return (g / (1.0 + jnp.exp(-g))).astype(dtype) * x_ref[:, pl.ds(k + i, 1)]  # silu in float32, rounded
        xc = x_ref[:, pl.ds(i, 1)]
        if prologue == "rmsnorm":
            xc = (xc.astype(jnp.float32) * scale).astype(dtype) * nw_ref[pl.ds(i, 1)][None, :]
        return xc

    (acc,) = _accumulate(column, [lambda i: w_ref[pl.ds(i, 1), :]], k, block_k, (m, block_n))
    y = acc.astype(dtype)
    if has_bias:
        y = y + b_ref[...][None, :]
    if has_residual:
        y = r_ref[...] + y
    o_ref[...] = y


def _rms_scale(x_ref, k: int, block_k: int, eps: float):
    """rsqrt(mean(x^2) + eps) per row of x_ref [M, >= K]: [M, 1] float32, summed column by column."""

    def chunk(c, ssq):
        for j in range(block_k):
            xc = x_ref[:, pl.ds(c * block_k + j, 1)].astype(jnp.float32)
            ssq = ssq + xc * xc
        return ssq

    ssq = jax.lax.fori_loop(0, k // block_k, chunk, jnp.zeros((x_ref.shape[0], 1), jnp.float32))
    return jax.lax.rsqrt(ssq / k + eps)


def _accumulate(column, weight_rows, k: int, block_k: int, shape):
    """sum over i < k of column(i) [M, 1] * row(i) [1, N] for each row function in weight_rows, in
    float32, one weight row after another (block_k unrolled per loop step): every output element
    sums its k products in the same order whatever M is. Returns one accumulator per row function."""

    def chunk(c, accs):
        for j in range(block_k):
            i = c * block_k + j
            xc = column(i).astype(jnp.float32)
            accs = tuple(a + xc * row(i).astype(jnp.float32) for a, row in zip(accs, weight_rows))
        return accs

    zero = tuple(jnp.zeros(shape, jnp.float32) for _ in weight_rows)
    return jax.lax.fori_loop(0, k // block_k, chunk, zero)


def _warps(m: int) -> int:
    """Triton warps per program: the [M, block_n] accumulator spread over more threads for many rows."""
    return 4 if m <= 16 else 8


def _compiler_params(num_warps: int):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=3)


def qkv_rope_write_reference(x, w, norm_w, bias, positions, inv_freq, kc, vc, slot, col, *, nh, nkv, eps):
    """Pure jnp. x [M, K] (RMSNorm-ed with norm_w [K] unless it is None); w [K, (nh + 2 nkv) D];
    positions, slot, col [M] int32; inv_freq [D/2];
    kc, vc [B, S, Hkv, D]. Returns (q [M, nh * D] after RoPE, kc, vc with row m's k (after RoPE) and v
    written at [slot[m], col[m]]; columns past S are dropped)."""
    m = x.shape[0]
    d = w.shape[1] // (nh + 2 * nkv)
    prologue = None if norm_w is None else "rmsnorm"
    y = rows_matmul_reference(x, w, prologue=prologue, norm_w=norm_w, eps=eps, bias=bias).reshape(m, -1, d)
    ang = positions[:, None].astype(jnp.float32) * inv_freq  # [M, D/2]
    cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
    lo, hi = jnp.split(y[:, : nh + nkv].astype(jnp.float32), 2, axis=-1)
    qk = jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], -1).astype(x.dtype)
    kc = kc.at[slot, col].set(qk[:, nh:], mode="drop")
    vc = vc.at[slot, col].set(y[:, nh + nkv :], mode="drop")
    return qk[:, :nh].reshape(m, nh * d), kc, vc


@functools.partial(
    jax.jit, static_argnames=("nh", "nkv", "eps", "interpret", "num_warps"), donate_argnames=("kc", "vc")
)
def qkv_rope_write(
    x, w, norm_w, bias, positions, inv_freq, kc, vc, slot, col, *, nh, nkv, eps, interpret=False, num_warps=None
):
    """RMSNorm (norm_w None: none) + the q/k/v projection + RoPE + the KV write in one kernel:
    `qkv_rope_write_reference`'s contract, with kc and vc updated in place (donated). One program per head (block_n = D): q heads
    write q, k heads their slot's cache column of kc, v heads of vc."""
    m, k = x.shape
    d = kc.shape[-1]
    n = w.shape[1]
    block_k = default_block_k(m, k)
    if not supported(m, k, n, block_k, d) or n != (nh + 2 * nkv) * d or d % 2:
        raise ValueError(f"qkv_rope_write: unsupported shapes M={m} K={k} N={n} D={d}")
    full = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)
    inputs = [x, w, positions, inv_freq.astype(jnp.float32), slot, col, kc, vc]
    in_specs = [full(x), pl.BlockSpec((k, d), lambda j: (0, j)), *map(full, inputs[2:])]
    if norm_w is not None:
        inputs.append(norm_w)
        in_specs.append(full(norm_w))
    if bias is not None:
        inputs.append(bias)
        in_specs.append(pl.BlockSpec((d,), lambda j: (j,)))
    kernel = functools.partial(
        _qkv_kernel,
        nh=nh,
        nkv=nkv,
        eps=eps,
        k=k,
        block_k=block_k,
        has_norm=norm_w is not None,
        has_bias=bias is not None,
    )
    return pl.pallas_call(
        kernel,
        grid=(nh + 2 * nkv,),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((m, d), lambda j: (0, jnp.minimum(j, nh - 1))), full(kc), full(vc)],
        out_shape=[
            jax.ShapeDtypeStruct((m, nh * d), x.dtype),
            jax.ShapeDtypeStruct(kc.shape, kc.dtype),
            jax.ShapeDtypeStruct(vc.shape, vc.dtype),
        ],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=_compiler_params(num_warps or _warps(m)),
        interpret=interpret,
        name="qkv_rope_write",
    )(*inputs)


def _qkv_kernel(*refs, nh, nkv, eps, k, block_k, has_norm, has_bias):
    x_ref, w_ref, pos_ref, f_ref, slot_ref, col_ref, _kc_in, _vc_in, *rest = refs
    nw_ref = rest.pop(0) if has_norm else None
    b_ref = rest.pop(0) if has_bias else None
    q_ref, kc_ref, vc_ref = rest
    from jax.experimental.pallas import triton as pltriton

    j = pl.program_id(0)
    m, d = q_ref.shape
    half = d // 2
    dtype = x_ref.dtype
    scale = _rms_scale(x_ref, k, block_k, eps) if has_norm else None

    def column(i):
        if not has_norm:
            return x_ref[:, pl.ds(i, 1)]
        return (x_ref[:, pl.ds(i, 1)].astype(jnp.float32) * scale).astype(dtype) * nw_ref[pl.ds(i, 1)][None, :]

    lo_row = lambda i: w_ref[pl.ds(i, 1), pl.ds(0, half)]
    hi_row = lambda i: w_ref[pl.ds(i, 1), pl.ds(half, half)]
    lo, hi = _accumulate(column, [lo_row, hi_row], k, block_k, (m, half))
    lo, hi = lo.astype(dtype), hi.astype(dtype)
    if has_bias:
        lo, hi = lo + b_ref[pl.ds(0, half)][None, :], hi + b_ref[pl.ds(half, half)][None, :]
    ang = pos_ref[...].astype(jnp.float32)[:, None] * f_ref[...][None, :]  # [M, D/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    lf, hf = lo.astype(jnp.float32), hi.astype(jnp.float32)
    is_v = j >= nh + nkv
    r_lo = jnp.where(is_v, lf, lf * cos - hf * sin).astype(dtype)
    r_hi = jnp.where(is_v, hf, hf * cos + lf * sin).astype(dtype)

    @pl.when(j < nh)
    def _():
        q_ref[:, pl.ds(0, half)] = r_lo
        q_ref[:, pl.ds(half, half)] = r_hi

    # every index an array [M, D/2] (the interpreter stores through integer indices only)
    col = col_ref[...][:, None]
    keep = jnp.broadcast_to(col < kc_ref.shape[1], (m, half))
    col = jnp.broadcast_to(jnp.minimum(col, kc_ref.shape[1] - 1), (m, half))
    slot = jnp.broadcast_to(slot_ref[...][:, None], (m, half))
    lanes = jax.lax.broadcasted_iota(jnp.int32, (m, half), 1)

    def write(ref, head):
        head = jnp.full((m, half), head, jnp.int32)
        pltriton.store(ref.at[slot, col, head, lanes], r_lo, mask=keep)
        pltriton.store(ref.at[slot, col, head, lanes + half], r_hi, mask=keep)

    pl.when((j >= nh) & (j < nh + nkv))(lambda: write(kc_ref, j - nh))
    pl.when(is_v)(lambda: write(vc_ref, j - nh - nkv))

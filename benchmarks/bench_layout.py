"""The weight layout of XLA:CPU matmuls: in-major x @ w against out-major `small_rows_matmul`, one run.

    python benchmarks/bench_layout.py [--rows 1 2 3 4 8 16 32 64] [--layers 30] [--int8]

A SmolLM2-135M-shaped stack of float32 weights (per layer: q/k/v 576 -> 960, o 576 -> 576, gate/up
576 -> 3072, down 1536 -> 576; 30 layers, 0.4 GB, far larger than the caches) multiplies a block of
`rows` activations layer after layer, as a decoding step (1 row), a verification tree (N rows) or a
batch of slots does; and the tied LM head (49152 x 576) gives logits for the same rows. In-major is
what GPU engines run (kernels [in, out], one dot); out-major is what CPU engines run since
`models/llama.py:out_major` (kernels [out, in]; 2 to SMALL_ROWS rows as a multiply-and-reduce pass).
Times are medians per call, jitted, after a warm-up, the two layouts alternating call by call.

--int8 times the quantized matmuls on the same stack instead: float32 in both layouts, int8
weight-only (the weight converted to float for the dot, as `--quantization int8` runs), w8a8_int8
(`models/llama.py:int8_matmul`: per-token int8 activations, int32 accumulation) and the same int8
dot without int8_matmul's padding of one row to two, and (up to SMALL_ROWS rows) w8a8_int8 through
the native int8 kernel on out-major weights, as CPU engines run it (jaxspec/native). The weight-only runs are timed after all the
others: the float weight copies they write slow the calls that follow for a while (by up to 1.7x).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine

from jaxspec import native
from jaxspec.models.llama import SMALL_ROWS, int8_matmul, small_rows_matmul
from jaxspec.quant import quantize_weight

LAYER = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) of q/k/v, o, gate/up, down


def stack(rng, layers: int) -> list[np.ndarray]:
    return [rng.standard_normal(s).astype(np.float32) * 0.05 for _ in range(layers) for s in LAYER]


def run_layers(matmul):
    """The block through every weight: each product's first columns (tiled when too few) feed the next."""

    @jax.jit
    def f(x, ws):
        for w in ws:
            din = w.shape[1] if matmul is small_rows_matmul else w.shape[0]
            if x.shape[-1] != din:
                x = jnp.tile(x, (1, -(-din // x.shape[-1])))[:, :din]
            x = matmul(x, w)
        return x

    return f


def alternate(fns: dict, n: int) -> dict:
    """Median ms per call of each (fn, args), the fns taking turns."""
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
    times: dict = {k: [] for k in fns}
    for _ in range(n):
        for k, (fn, args) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - t)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--int8", action="store_true", help="time the quantized matmuls instead (see the docstring)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ws = stack(rng, args.layers)
    if args.int8:
        return int8_table(ws, args, rng)
    in_major = [jnp.asarray(w) for w in ws]
    out_major = [jnp.asarray(np.ascontiguousarray(w.T)) for w in ws]
    emb = jnp.asarray(rng.standard_normal((49152, 576)).astype(np.float32) * 0.05)
    head_in = jax.jit(lambda h, e: jnp.einsum("mh,vh->mv", h, e, preferred_element_type=jnp.float32))
    head_out = jax.jit(lambda h, e: small_rows_matmul(h, e, jnp.float32))
    gb = sum(w.nbytes for w in ws) / 1e9
    print(f"machine: {machine()}")
    print(f"{args.layers} layers of SmolLM2-135M-shaped float32 weights ({gb:.2f} GB) and its tied LM head (0.11 GB)")
    print(
        "| rows | layers in-major ms | layers out-major ms | ratio | LM head in-major ms | LM head out-major ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    f_in, f_out = run_layers(lambda x, w: x @ w), run_layers(small_rows_matmul)
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
        t = alternate(
            {
                "li": (f_in, (x, in_major)),
                "lo": (f_out, (x, out_major)),
                "hi": (head_in, (x, emb)),
                "ho": (head_out, (x, emb)),
            },
            args.calls,
        )
        print(
            f"| {rows} | {t['li']:.2f} | {t['lo']:.2f} | {t['li'] / t['lo']:.2f}x "
            f"| {t['hi']:.2f} | {t['ho']:.2f} | {t['hi'] / t['ho']:.2f}x |",
            flush=True,
        )


def int8_dot_unpadded(x, w, s):
    """int8_matmul's arithmetic with no padding of one row: what XLA:CPU does with a one-row int8 dot."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    xs = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x / xs), -127, 127).astype(jnp.int8)
    return jax.lax.dot(xq, w, preferred_element_type=jnp.int32).astype(jnp.float32) * xs * s


def int8_table(ws, args, rng):
    quant = [quantize_weight(w, "w8a8_int8") for w in ws]
    in_major = [jnp.asarray(w) for w in ws]
    out_major = [jnp.asarray(np.ascontiguousarray(w.T)) for w in ws]
    qs = [q for q, _ in quant]
    scales = [s for _, s in quant]
    print(f"machine: {machine()}")
    gb = sum(w.nbytes for w in ws) / 1e9
    print(f"{args.layers} layers of SmolLM2-135M-shaped weights: float32 {gb:.2f} GB, int8 {gb / 4:.2f} GB")
    print(
        "| rows | f32 in-major ms | f32 out-major ms | int8 weight-only ms | w8a8_int8 (XLA int8 dot) ms "
        "| w8a8, one row unpadded ms | w8a8_int8 native kernel ms |"
    )
    print("|---|---|---|---|---|---|---|")
    f_in, f_out = run_layers(lambda x, w: x @ w), run_layers(small_rows_matmul)

    def scaled(mm, in_axis=0):
        @jax.jit
        def f(x, qs, scales):
            for q, s in zip(qs, scales):
                din = q.shape[in_axis]
                if x.shape[-1] != din:
                    x = jnp.tile(x, (1, -(-din // x.shape[-1])))[:, :din]
                x = mm(x, q, s)
            return x

        return f

    f_wo = scaled(lambda x, q, s: (x @ q.astype(x.dtype)) * s)
    f_w8, f_raw = scaled(int8_matmul), scaled(int8_dot_unpadded)
    f_nat = scaled(lambda x, q, s: int8_matmul(x, q, s, out_major=True), in_axis=1)
    qs_out = [jnp.asarray(np.ascontiguousarray(np.asarray(q).T)) for q in qs]
    xs = {rows: jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32)) for rows in args.rows}
    times = {}
    for rows, x in xs.items():
        fns = {
            "in": (f_in, (x, in_major)),
            "out": (f_out, (x, out_major)),
            "w8": (f_w8, (x, qs, scales)),
        }
        if rows == 1:
            fns["raw"] = (f_raw, (x, qs, scales))
        if native.available() and rows <= SMALL_ROWS:
            fns["nat"] = (f_nat, (x, qs_out, scales))
        times[rows] = alternate(fns, args.calls)
    # last, and apart: the float weight copies it writes (0.4 GB a call) slow other calls for a while
    for rows, x in xs.items():
        times[rows] |= alternate({"wo": (f_wo, (x, qs, scales))}, args.calls)
    for rows, t in times.items():
        raw, nat = (f"{t[k]:.2f}" if k in t else "–" for k in ("raw", "nat"))
        print(f"| {rows} | {t['in']:.2f} | {t['out']:.2f} | {t['wo']:.2f} | {t['w8']:.2f} | {raw} | {nat} |")


if __name__ == "__main__":
    main()

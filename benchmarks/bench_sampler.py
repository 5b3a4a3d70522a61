"""The sampler alone: jaxspec's sort-free `sample` vs a full-vocabulary sort, same inputs, one run;
and the greedy pick: jaxspec's `argmax` vs jnp.argmax.

    python benchmarks/bench_sampler.py [--vocab 49152] [--rows 1 8 64]

The sort-based sampler is the textbook one (sort descending, cumulative sum for top-p, draw with
jax.random.categorical), as jaxspec sampled before. Times are per call, jitted, after a warm-up, for
temperature only and for every filter on (top-k 50, top-p 0.9, min-p 0.05); jaxspec's is the sampler
the engine picks for such requests (`sampling_kind`: temperature only needs no threshold search).
The argmax times are per call inside one jitted loop of 100 calls (no dispatch per call).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine

from jaxspec.sampling import SamplingParams, SamplingTensors, argmax, sample, sampling_kind


def sort_sample(logits, st: SamplingTensors, keys):
    """Filters by sorting the vocabulary, then jax.random.categorical (the reference)."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(st.temperature, 1e-6)[:, None]
    ids = jnp.argsort(-scaled, axis=-1)
    vals = jnp.take_along_axis(scaled, ids, axis=-1)
    probs = jax.nn.softmax(vals, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = rank < jnp.where(st.top_k > 0, st.top_k, v)[:, None]
    keep &= (jnp.cumsum(probs, axis=-1) - probs) <= st.top_p[:, None]
    keep &= probs >= st.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, vals, -jnp.inf))
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]


def per_call_ms(fn, *args, n=20) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n * 1e3


def looped_us(pick, x, n: int = 100) -> float:
    """Microseconds per call of pick(x) [R, V] -> [R], inside one jitted loop of n calls."""

    def body(_, acc):  # each call reads x afresh (acc[0] * 0 keeps it inside the loop)
        return acc + pick(x + acc[0].astype(x.dtype) * 0)

    run = jax.jit(lambda x: jax.lax.fori_loop(0, n, body, jnp.zeros(x.shape[0], jnp.int32)))
    return min(per_call_ms(run, x, n=3) for _ in range(3)) / n * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    args = ap.parse_args()
    print(f"machine: {machine()}; vocabulary {args.vocab}")
    print("| rows | filters | sort-based ms | jaxspec ms | ratio |")
    print("|---|---|---|---|---|")
    # the sampler the engine picks for these requests (temperature only: no threshold search)
    ours = jax.jit(lambda lg, st, z, k, kind: sample(lg, st, z, z > 0, k, kind), static_argnums=4)
    ref = jax.jit(sort_sample)
    for r in args.rows:
        logits = jnp.asarray(np.random.default_rng(0).normal(size=(r, args.vocab)).astype(np.float32) * 3)
        zeros = jnp.zeros((r, args.vocab), jnp.int32)
        for name, p in [
            ("temperature 1", SamplingParams(temperature=1.0)),
            ("top-k 50, top-p 0.9, min-p 0.05", SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)),
        ]:
            st = SamplingTensors.build([p] * r, list(range(r)))
            a = per_call_ms(ref, logits, st, st.keys)
            b = per_call_ms(ours, logits, st, zeros, st.keys, sampling_kind([p]))
            print(f"| {r} | {name} | {a:.2f} | {b:.2f} | {a / b:.1f}× |", flush=True)
    print("\n| rows | jnp.argmax us | jaxspec argmax us | ratio |\n|---|---|---|---|")
    for r in args.rows:
        logits = jnp.asarray(np.random.default_rng(1).normal(size=(r, args.vocab)).astype(np.float32))
        a = looped_us(lambda x: jnp.argmax(x, -1).astype(jnp.int32), logits)
        b = looped_us(argmax, logits)
        print(f"| {r} | {a:.1f} | {b:.1f} | {a / b:.1f}× |", flush=True)


if __name__ == "__main__":
    main()

"""How many kernels one plain decode step runs, per weight quantization, and what a kernel costs on
XLA:CPU beyond its arithmetic.

    python benchmarks/bench_kernels.py [--quantization none w8a8_int8 int8] [--tokens 128]

For each mode: the plain decode program of the default model (one slot, greedy) is compiled, and
the instructions of its decode loop's body are counted by opcode (each fusion, dot and copy is one
kernel the runtime launches per step); then decoding is timed (--tokens tokens after a 61-token
prompt, best of 3, less the time of the same request cut at its first token). Last, the launch
cost of an almost empty kernel: a `while_loop` whose body is a chain of --chain links of two tiny
kernels each, timed against the same loop with one link.
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import jax
import jax.numpy as jnp
from common import machine

import jaxspec
import jaxspec.engine as engine_module


def loop_body_ops(hlo: str) -> collections.Counter:
    """Opcode counts of the largest while-loop body in compiled HLO text."""
    comps: dict[str, list[str]] = {}
    cur = None
    for line in hlo.split("\n"):
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif cur and line.startswith("  "):
            comps[cur].append(line)
    bodies = [comps.get(b, []) for b in set(re.findall(r"body=%?([\w.\-]+)", hlo))]
    ops: collections.Counter = collections.Counter()
    for line in max(bodies, key=len, default=[]):
        m = re.match(r"\s+(?:ROOT )?%?\S+ = [^ ]+ (\w[\w\-]*)\(", line)
        if m and m.group(1) not in ("get-tuple-element", "tuple", "constant", "parameter"):
            ops[m.group(1)] += 1
    return ops


def decode_kernels(quantization: str | None, tokens: int) -> tuple[collections.Counter, float]:
    """(kernels of one decode step by opcode, ms per token) for the default model."""
    real, hlo = engine_module.decode, []

    def spy(*args, **kwargs):
        hlo.append(real.lower(*args, **kwargs).compile().as_text())
        return real(*args, **kwargs)

    engine_module.decode = spy
    try:
        eng = jaxspec.Engine(
            speculative_algorithm="NONE",
            show_progress=False,
            dtype="float32",  # quantization None: float32 (not the CPU's gguf default)
            context_length=1024,
            max_running_requests=1,
            quantization=quantization,
        )
        ids = [[1] + list(range(100, 160))]
        full = dict(temperature=0, max_new_tokens=tokens + 1, ignore_eos=True)
        first = dict(full, max_new_tokens=1)
        eng.generate(input_ids=ids, sampling_params=full)
        eng.generate(input_ids=ids, sampling_params=first)
    finally:
        engine_module.decode = real
    per_token = []
    for _ in range(3):
        t = time.perf_counter()
        eng.generate(input_ids=ids, sampling_params=full)
        a = time.perf_counter() - t
        t = time.perf_counter()
        eng.generate(input_ids=ids, sampling_params=first)
        per_token.append((a - (time.perf_counter() - t)) / tokens)
    return loop_body_ops(hlo[0]), 1e3 * min(per_token)


def launch_cost(chain: int, iters: int = 2000) -> float:
    """Microseconds per extra kernel: a loop body of `chain` links against one link, each link a
    reduction and the elementwise update that reads it (two kernels: XLA does not fuse a
    reduction into its consumer) over 8 floats."""

    def loop(n):
        def body(c):
            i, x = c
            for _ in range(n):
                x = x * 0.999 + jnp.max(x) * 1e-4
            return i + 1, x

        return jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < iters, body, (0, x))[1])

    x = jnp.ones((8,), jnp.float32)
    times = {}
    for n in (1, chain):
        f = loop(n)
        f(x).block_until_ready()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            f(x).block_until_ready()
            best = min(best, time.perf_counter() - t)
        times[n] = best / iters
    return 1e6 * (times[chain] - times[1]) / (2 * (chain - 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", nargs="+", default=["none", "w8a8_int8", "int8"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--chain", type=int, default=200)
    args = ap.parse_args()
    print(f"# {machine()}")
    print("| quantization | kernels per decode step | fusions | dots | other | ms per token | vs the first |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for q in args.quantization:
        ops, ms = decode_kernels(None if q == "none" else q, args.tokens)
        base = ms if base is None else base
        fus, dots = ops.get("fusion", 0), ops.get("dot", 0)
        other = sum(ops.values()) - fus - dots
        print(f"| {q} | {sum(ops.values())} | {fus} | {dots} | {other} | {ms:.2f} | {base / ms:.2f}x |", flush=True)
    print(f"\nlaunch cost of a tiny kernel inside a while loop: {launch_cost(args.chain):.2f} µs")


if __name__ == "__main__":
    main()

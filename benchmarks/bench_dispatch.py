"""What one server dispatch costs, per program kind: the plain server's decode steps against the
speculative server's candidates (the configured tree, the shallower one, plain steps that keep the
draft up to date), at a given number of busy slots and KV span.

    python benchmarks/bench_dispatch.py [--slots 1 4 16] [--span 256] [--reps 12] [--in-major] [--sampled]
        [--temperature 0] [--top-p 1]

--in-major: the engines keep in-major kernels (CPU engines otherwise store them out-major,
models/llama.py:out_major), to compare the layouts run against run.

--sampled: the sampling programs (which serve any mix of greedy and sampled slots) instead of the
greedy-only ones; --temperature / --top-p: what every slot asks for (default greedy; a temperature
above 0 needs --sampled). --straight-line: the sampler's work is not skipped where no slot needs
it (on CPU it is, by a conditional; GPU programs stay straight-line).

Every slot decodes from a committed context of span / 2 columns, with no stop in sight;
each program runs once untimed, then --reps times. Reported per program: the median dispatch
time, the tokens it emitted per slot (the acceptance here is that of a context of zeros, so only
the cost columns carry over to real text) and the cost of one round (one decode step of the plain
server) relative to the plain server's step. A tree round pays only when it emits more tokens than
that ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import BENCH_CONTEXT, add_model_arguments, machine

import jaxspec
from jaxspec import sampling
from jaxspec.cache import KVCache
from jaxspec.sampling import SamplingParams, SamplingTensors
from jaxspec.server.scheduler import Scheduler


def time_dispatch(
    sched: Scheduler,
    n: int,
    span: int,
    shape: str,
    reps: int,
    sampled: bool = False,
    params: SamplingParams | None = None,
) -> tuple[float, float, float]:
    """(median seconds per dispatch, tokens emitted per slot, rounds per slot) of the greedy (or
    `sampled`: the sampling) dispatch program of `shape` for slots [0, n) at `span`, every slot
    asking for `params` (default greedy)."""
    key = ("dispatch", n, span, sampled, shape, False, False)
    prog = sched.programs.get(key)
    sched.programs.exercise(key, prog)
    grammar = None if sched.batch.st.grammar is None else [-1] * n  # unconstrained handles
    rows = SamplingTensors.build([params or SamplingParams(temperature=0.0)] * n, list(range(n)), grammar)
    sched.batch = dataclasses.replace(
        sched.batch, st=jax.tree_util.tree_map(lambda full, part: full.at[:n].set(part), sched.batch.st, rows)
    )
    times = []
    for _ in range(reps + 1):
        b = sched.batch
        ctx = lambda x: dataclasses.replace(x, lengths=x.lengths.at[:n].set(span // 2)) if isinstance(x, KVCache) else x
        core = jax.tree_util.tree_map(ctx, b.core, is_leaf=lambda x: isinstance(x, KVCache))
        core = dataclasses.replace(
            core, done=core.done.at[:n].set(False), num_out=core.num_out.at[:n].set(1), base=core.base.at[:n].set(1)
        )
        if hasattr(core, "verify_ct"):
            core = dataclasses.replace(core, verify_ct=core.verify_ct.at[:n].set(0))
        b = dataclasses.replace(b, core=core, max_new=b.max_new.at[:n].set(1 << 20), stop_ids=b.stop_ids.at[:n].set(-1))
        b = jax.block_until_ready(b)
        t = time.perf_counter()
        sched.batch, outs = prog(sched.eng.models, b, jnp.zeros((sched.slots,), bool))
        count, vct = jax.device_get((outs[1], outs[4]))
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:])), float(np.mean(count[:n])), float(np.mean(vct[:n]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--span", type=int, default=256)
    ap.add_argument("--reps", type=int, default=12)
    add_model_arguments(ap, BENCH_CONTEXT)
    ap.add_argument("--in-major", action="store_true", help="in-major kernels (the layout GPU engines use)")
    ap.add_argument(
        "--sampled",
        action="store_true",
        help="the sampling programs (they serve any mix of greedy and sampled slots)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="every slot's temperature (> 0 needs --sampled)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every slot's top_p")
    ap.add_argument(
        "--straight-line",
        action="store_true",
        help="the sampler computes what no slot needs too, as GPU programs do (sampling.SKIP_UNUSED = False)",
    )
    args = ap.parse_args()
    if args.straight_line:
        sampling.SKIP_UNUSED = False
    if args.temperature > 0 and not args.sampled:
        ap.error("--temperature above 0 needs --sampled (greedy programs have no sampler)")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    kw = dict(
        show_progress=False,
        model_path=args.model_path,
        dtype="float32",  # the float32 model, whose default is the shipped draft (a GGUF's CPU default, gguf, has none)
        context_length=args.context_length,
        _out_major=not args.in_major,
    )
    plain = jaxspec.Engine(speculative_algorithm="NONE", **kw)
    spec = jaxspec.Engine(**kw)
    print(
        f"machine: {machine()}; span {args.span}, {'sampling' if args.sampled else 'greedy'} programs, "
        f"slots at temperature {args.temperature:g}, top_p {args.top_p:g}, "
        f"{'straight-line sampler' if args.straight_line else 'sampler skips unused work'}, {'in' if args.in_major else 'out'}-major kernels"
    )
    print("| slots | program | ms per dispatch | tokens per slot | rounds per slot | round / plain step |")
    print("|---|---|---|---|---|---|")
    for n in args.slots:
        sp, ss = Scheduler(plain, max_running_requests=n), Scheduler(spec, max_running_requests=n)
        ms, toks, _ = time_dispatch(sp, n, args.span, sp.main_shape, args.reps, args.sampled, params)
        step = ms / toks
        print(f"| {n} | plain server | {ms * 1e3:.1f} | {toks:.1f} | {toks:.1f} | 1.00 |", flush=True)
        for shape in ss.shapes:
            ms, toks, rounds = time_dispatch(ss, n, args.span, shape, args.reps, args.sampled, params)
            name = "plain steps (off)" if shape == "off" else f"tree {shape}"
            print(
                f"| {n} | {name} | {ms * 1e3:.1f} | {toks:.1f} | {rounds:.1f} | {ms / rounds / step:.2f} |", flush=True
            )
        del sp, ss
        jax.clear_caches()


if __name__ == "__main__":
    main()

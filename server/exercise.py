"""Running a compiled program once before it serves (server/programs.py).

XLA:CPU sets up a program's kernels when it first runs: a first run costs about 0.5 s more than
the next for a decoding program and up to twice a steady run for a short prefill chunk, which a
request would otherwise pay. So each program is run once on free request slots while no slot is in
use: at start-up the prefill and admission programs, and the decoding programs, like every program
compiled in the background, at the scheduler's first idle moments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.sampling import SamplingParams, SamplingTensors
from jaxspec.sharding import put, to_host, to_mesh


def worth_exercising(key: tuple) -> bool:
    """Whether running `key` once ahead (exercise) pays. Not for prefill chunks over more than
    1024 columns: their first run spends seconds on attention either way (15 s for a 512-token
    chunk at 8256 columns with SmolLM2 on a 2-core CPU), and the one-time set-up, under a second,
    is a small part of it, while running them at start-up cost a restart 23 s."""
    return not (key[0] == "chunk" and key[3] > 1024)


def exercise(programs: Any, key: tuple, prog: Any) -> None:
    """Runs a compiled program once on the scheduler's batch while no slot is in use (scheduler
    thread, or before it starts). XLA:CPU sets up a program's kernels when they first run, which
    would otherwise make the first request of each new shape about twice as slow as the next.
    The slots used are free: their contents are overwritten when a request is admitted."""
    s, eng = programs.sched, programs.sched.eng
    i32 = jnp.int32
    # several hosts: host values as arrays over the whole mesh (server/nodes.py); else as they are
    g = (lambda t: to_mesh(to_host(t), eng.mesh)) if jax.process_count() > 1 else (lambda t: t)

    def params(n):  # row 0 samples (the sampler's draw path), the rest are greedy
        return g(
            SamplingTensors.build(
                [SamplingParams(temperature=1.0)] + [SamplingParams(temperature=0.0)] * (n - 1),
                [0] * n,
                [-1] * n if s.grammar else None,
            )
        )

    if key[0] == "copy":
        s.forget([0], 0)
        s.batch = prog(s.batch, *g((jnp.int32(0), jnp.int32(0), jnp.int32(0))))
    elif key[0] == "chunk":
        _, n, c, span = key
        start = max(min(span, s.max_len) - c, 0)
        s.forget(range(n), start)
        s.batch = prog(
            eng.models,
            s.batch,
            *g(
                (
                    jnp.arange(n, dtype=i32),
                    jnp.zeros((n, c), i32),
                    jnp.zeros((n, c), i32),
                    jnp.int32(start),
                    jnp.full((n,), start + c, i32),
                )
            ),
        )
    elif key[0] == "finish":
        _, n = key
        s.forget(range(n), 0)
        s.batch, _ = prog(
            eng.models,
            s.batch,
            g(jnp.arange(n, dtype=i32)),
            params(n),
            *g(
                (
                    jnp.full((n,), 2, i32),
                    jnp.full((n, s.num_stop), -1, i32),
                    jnp.zeros((n,), bool),
                    jnp.zeros((n, eng.cfg.vocab_size), bool),
                )
            ),
        )
    else:  # slots [0, n_act) decode k rounds from one committed column, with no stop in sight
        n = key[1]
        s.forget(range(n), 0)
        b = s.batch
        fresh = lambda x: dataclasses.replace(x, lengths=x.lengths.at[:n].set(1)) if isinstance(x, KVCache) else x
        core = jax.tree_util.tree_map(fresh, b.core, is_leaf=lambda x: isinstance(x, KVCache))
        core = dataclasses.replace(
            core, done=core.done.at[:n].set(False), num_out=core.num_out.at[:n].set(1), base=core.base.at[:n].set(1)
        )
        st = jax.tree_util.tree_map(lambda full, part: full.at[:n].set(part), b.st, params(n))
        b = dataclasses.replace(
            b, core=core, st=st, max_new=b.max_new.at[:n].set(1 << 20), stop_ids=b.stop_ids.at[:n].set(-1)
        )
        s.batch, _ = prog(eng.models, b.placed(put), g(jnp.zeros((s.slots,), bool)))
    jax.block_until_ready(s.batch)

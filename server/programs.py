"""The server's compiled device programs, by shape key: compiled ahead of time, in the background
within budgets, and looked up per call.

The keys, the shapes that exist, the start-up cover set, the background list and the choice of the
compiled program that serves a call are server/program_shapes.py's (`ProgramShapes`, which
`Programs` inherits). So that no request has to wait for XLA, start-up compiles the cover set
(`compile_startup`), and a background thread then compiles every other shape (with the persistent
compilation cache, a restart loads them from disk: as JAX serialized them, without tracing, from
server/program_store.py, else from JAX's cache). A call served through a larger program asks for its
own (`want`; the scheduler asks for the configured shape's and plain steps', and a prefill served by
larger chunks or from an earlier position for the ideal chunks), which the background thread
compiles before the rest of its list (on a CPU, where background compiles wait for a quiet moment,
also under steady load once it has waited WANTED_WAIT). Only with --disable-cuda-graph (nothing
compiled ahead) does a call compile on first use.

What programs cost: on a CPU each holds tens to hundreds of MB of host memory and about a thousand
memory maps (measured over the start-up set, server/memory.py ProgramMemory). The background list
stops at a budget for their memory (a tenth of host RAM, at most 2.5 GiB) or at MAP_BUDGET of the
kernel's memory-map limit, whichever comes first; the programs calls want go on up to twice that
memory (server/memory.py WANTED_MEMORY) and WANTED_BUDGET of the maps; the start-up set is always
compiled.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxspec.native import host_call
from jaxspec.sampling import SamplingTensors
from jaxspec.server.exercise import exercise, worth_exercising
from jaxspec.server.memory import WANTED_MEMORY, ProgramMemory, map_usage, program_budget, trim_heap
from jaxspec.server.program_shapes import ProgramShapes
from jaxspec.server.program_store import ProgramStore, compile_again, compile_fresh, store_path
from jaxspec.serving import admit_chunk, admit_finish, copy_prefix, dispatch
from jaxspec.weights import Models

logger = logging.getLogger("jaxspec.server")

# Background compiles stop once the process holds this share of the kernel's memory-map limit
# (vm.max_map_count, 65530 by default): an XLA:CPU program maps about 800 regions, so a few
# dozen programs beyond the start-up set would make the next compile fail and abort the process.
MAP_BUDGET = 0.7
# Programs calls asked for (`want`: the configured shape's and plain steps' at the batch size and
# span of a call that a larger program served; through the larger one, plain steps cost 5x as much
# on a 2-core CPU) are compiled first, and past MAP_BUDGET up to this share.
WANTED_BUDGET = 0.8
# On a CPU background compiles wait for a quiet moment (a compile takes a core from the requests),
# except a program calls asked for that has waited this long: under steady load no quiet moment
# comes, and the calls it would serve run through a larger program meanwhile, at up to twice
# their cost (a batch of 4 through the program for 8 slots).
WANTED_WAIT = 5.0


def _spec(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _sig(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (
        treedef,
        tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves if hasattr(x, "shape")),
    )


# Compiled programs of every Scheduler in this process, so that schedulers over the same model and
# shapes (a restarted server, tests) share them, as jax.jit's own cache would:
# static signature -> {key: jax Compiled}
_COMPILED: dict[tuple, dict[tuple, Any]] = {}
_COMPILED_LOCK = threading.Lock()


_UNSET = object()  # Programs._table_for before the first lookup


def clear_cache() -> None:
    """Drops every compiled program (with jax.clear_caches(): frees their memory mappings)."""
    with _COMPILED_LOCK:
        _COMPILED.clear()


class Programs(ProgramShapes):
    """Compiled programs of one Scheduler, keyed as in server/program_shapes.py."""

    def __init__(self, sched, lazy: bool = False):
        self.sched = sched
        self.lazy = lazy  # --disable-cuda-graph: compile on first use only
        self.lock = _COMPILED_LOCK
        self.compiles_on_demand = 0  # calls that had to wait for a compile
        self._batch_spec = jax.tree_util.tree_map(_spec, sched.batch)
        self._params_spec = jax.tree_util.tree_map(_spec, sched.eng.params)
        eng = sched.eng
        self._static = (
            eng.graphdef,
            sched.prop,
            sched.spec,
            sched.k,
            eng.backend,
            sched.slots,
            sched.max_len,
            sched.num_stop,
            _sig(self._batch_spec),
            _sig(self._params_spec),
        )
        self._table_for: Any = _UNSET  # the eng.dparams that self._tbl was looked up for (None: no draft)
        self._tbl: dict[tuple, Any] = {}
        self._store: ProgramStore | None = None  # compiled programs on disk (server/program_store.py)
        self.unstored: collections.deque = collections.deque()  # keys compiled but not stored
        self.storing = 0  # keys being compiled again for the store now (store_again)
        self._thread: threading.Thread | None = None
        self.compiles_begun = self.compiles_ended = 0  # compile_mark
        self._stop = False
        self.background_total = 0
        self.startup_bs = sched.slots  # the batch sizes compile_startup covered exactly
        self.background_done = 0
        self.idle_only = jax.devices()[0].platform == "cpu"  # background compiles only while no request runs
        # (key, program) compiled in the background, not yet run once
        self.fresh: collections.deque = collections.deque()
        self.wanted: collections.deque = collections.deque()  # keys calls asked for (`want`), compiled first
        self._asked: set[tuple] = set()
        self.wanted_at: dict[tuple, float] = {}  # when each wanted key was asked for
        self.memory = ProgramMemory(program_budget())  # what compiled programs take, and may

    # ---- compiling -----------------------------------------------------------------------------

    def _table(self) -> dict[tuple, Any]:
        """The compiled programs (key -> program) for everything a program is specialised on besides
        its key. Looked up again only when eng.dparams is replaced (NGRAM's corpus grows), not per call."""
        dparams = self.sched.eng.dparams
        if self._table_for is not dparams:
            sig = self._static + (_sig(dparams),)
            with self.lock:
                self._tbl = _COMPILED.setdefault(sig, {})
            folder = store_path()
            self._store = None if folder is None else ProgramStore(folder, repr(sig))
            self._table_for = dparams
        return self._tbl

    def _lower(self, key: tuple):
        fn, args, static = self._call(key)
        return fn.lower(*args, **static)

    def _in_tree(self, key: tuple):
        """The argument structure `key`'s program takes (what jax's Compiled.in_tree holds), without tracing."""
        _, args, _ = self._call(key)
        if key[0] == "dispatch":  # its tree shape (args[1]) is a static argument
            args = args[:1] + args[2:]
        return jax.tree_util.tree_structure((args, {}))

    def _call(self, key: tuple) -> tuple[Any, tuple, dict]:
        """(jitted function, argument specs, static arguments) of `key`'s program."""
        s, eng = self.sched, self.sched.eng
        i32 = jnp.int32
        sds = jax.ShapeDtypeStruct
        dparams = jax.tree_util.tree_map(_spec, eng.dparams)
        models = Models(eng.graphdef, self._params_spec, s.prop, dparams, eng.backend)
        if key[0] == "dispatch":
            _, n_act, span, sampled, shape, logprobs, grammar = key
            static = dict(k=s.k, n_act=n_act, span=span, sampled=sampled, logprobs=logprobs, grammar=grammar)
            return dispatch, (models, s.shapes[shape], self._batch_spec, sds((s.slots,), bool)), static
        if key[0] == "copy":
            return copy_prefix, (self._batch_spec, sds((), i32), sds((), i32), sds((), i32)), {}
        if key[0] == "chunk":
            _, n, c, span = key
            args = (models, self._batch_spec, sds((n,), i32), sds((n, c), i32), sds((n, c), i32), sds((), i32))
            return admit_chunk, (*args, sds((n,), i32)), dict(span=span)
        _, n = key
        st = jax.eval_shape(lambda: SamplingTensors.build_default(n, s.grammar))
        args = (models, self._batch_spec, sds((n,), i32), st, sds((n,), i32), sds((n, s.num_stop), i32))
        return admit_finish, (*args, sds((n,), bool), sds((n, eng.cfg.vocab_size), bool)), dict(span=s.max_len)

    def compile(self, key: tuple) -> Any:
        tbl = self._table()
        with self.lock:
            if key in tbl:
                return tbl[key]
        with self.lock:
            self.compiles_begun += 1
        logger.debug("compiling %s", key)
        try:
            store = self._store
            prog = store.load(key, self._in_tree(key)) if store is not None else None
            if prog is None:
                with host_call.recording() as callbacks:
                    lowered = self._lower(key)
                prog, fresh = compile_fresh(lowered.compile)
                if store is not None and not callbacks:
                    if fresh:
                        store.save(key, prog)
                    else:  # from JAX's cache: compiled again in the background, then stored
                        self.unstored.append(key)
        finally:
            with self.lock:
                self.compiles_ended += 1
        with self.lock:
            tbl[key] = prog
        trim_heap()  # the compile's scratch memory goes back to the kernel
        return prog

    def compile_mark(self) -> tuple[int, int]:
        """(compiles begun, ended) so far: two equal marks with begun == ended mean no compile ran
        in between (adaptive speculation takes no cost sample of a dispatch that shared the CPU
        with one)."""
        with self.lock:
            return self.compiles_begun, self.compiles_ended

    def compile_startup(self, max_bs: int, progress: bool = True) -> int:
        """Compiles the cover set (before the scheduler thread starts) and exercises the programs a
        request's first token needs (prefill chunks, admission); the dispatch programs are run once
        each at the scheduler's first idle moments after the server is up (their first run costs
        about 0.5 s more than the next, against a second or more for running them here)."""
        self.startup_bs = max_bs
        keys = self.startup_keys(max_bs)
        bar = tqdm(total=len(keys), unit="program", disable=not progress, desc="compiling start-up programs")
        later = []
        # XLA compiles one program on one core (and releases the GIL): compile as many at once as there are cores
        with ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, 8))) as pool:
            for key, prog in zip(keys, pool.map(self.compile, keys)):
                if key[0] == "dispatch":
                    later.append((key, prog))
                elif worth_exercising(key):
                    self.exercise(key, prog)
                bar.update(1)
        bar.close()
        self.fresh.extend(later)
        return len(keys)

    def exercise(self, key: tuple, prog) -> None:
        """Runs a compiled program once on free slots (server/exercise.py)."""
        exercise(self, key, prog)

    def background_left(self) -> int:
        """Background work not done yet, each item a compile or a program's first run: shapes to
        compile, programs to compile again for the store, programs compiled but not yet run once.
        Zero means the background will take no core until a call asks for a new program."""
        with self.lock:
            compiles = max(self.background_total - self.background_done, 0)
        return compiles + len(self.unstored) + self.storing + len(self.fresh)

    def want(self, key: tuple) -> None:
        """Asks the background thread to compile `key` before its own list (once per key; nothing
        when it is compiled already, without a background thread, or once it has stopped for
        good)."""
        if key in self._asked or self._thread is None or self._stop:
            return
        self._asked.add(key)
        if key not in self._table():
            with self.lock:
                self.background_total += 1
            self.wanted_at[key] = time.perf_counter()
            self.wanted.append(key)

    def start_background(self) -> None:
        """Compiles the keys calls `want`, then background_keys(), in a low-priority thread (stopped
        by stop()). The list stops at the programs' memory budget or at MAP_BUDGET; the thread
        then keeps compiling wanted keys while the programs stay within WANTED_MEMORY times their
        budget (server/memory.py) and the process under WANTED_BUDGET of the memory-map limit.
        Nothing starts when the programs compiled so far leave no room even for wanted keys
        (logged)."""
        keys = collections.deque(self.background_keys())
        if not self.memory.room(wanted=True):
            self._over_budget(len(keys))
            return
        self.background_total = listed = len(keys)
        t = time.perf_counter()

        def drop_list(why: str, *what) -> None:
            """Stops the list (the wanted keys go on), with a warning saying why."""
            nonlocal listed
            logger.warning(
                "background compiles stopped after %d programs, %d left: " + why + "; the shapes left are served by "
                "larger programs, and the exact programs calls ask for are still compiled",
                self.background_done,
                len(keys),
                *what,
            )
            with self.lock:
                self.background_total -= len(keys)
            keys.clear()
            listed = 0

        def next_key():
            """The next key to compile (None: stop), after waiting for a quiet moment on a CPU. The
            budgets are checked only then: reading the process's memory maps takes 12-20 ms at
            35,000-53,000 maps, and done every 0.1 s it kept an idle server at 14% of a core."""
            while not self._stop:
                if not (self.wanted or keys or self.unstored):
                    time.sleep(0.1)
                    continue
                # on a CPU, compiling takes the cores a request would use: wait for a quiet moment,
                # or WANTED_WAIT for a wanted key
                waited = self.wanted and time.perf_counter() - self.wanted_at.get(self.wanted[0], 0.0) >= WANTED_WAIT
                if self.idle_only and not waited and not self.sched.idle_for(0.5):
                    time.sleep(0.1)
                    continue
                m = self.memory
                if keys and not m.room():
                    drop_list(
                        "%d compiled programs take about %.2f GiB of their %.2f GiB budget (a tenth of host RAM, at "
                        "most 2.5 GiB)",
                        m.count,
                        m.bytes / 2**30,
                        m.budget_bytes / 2**30,
                    )
                if self.wanted and not m.room(wanted=True):
                    self._over_budget(len(self.wanted))
                    return None
                usage = map_usage()
                share = usage[0] / usage[1] if usage is not None else 0.0
                if keys and share > MAP_BUDGET:
                    drop_list("the process holds %d memory maps of the kernel's %d (vm.max_map_count)", *usage)
                if share > WANTED_BUDGET:
                    logger.warning(
                        "background compiles stopped for good after %d programs: the process holds %d memory maps of "
                        "the kernel's %d (vm.max_map_count); calls are served by the programs compiled so far",
                        self.background_done,
                        *usage,
                    )
                    with self.lock:
                        self.background_total = self.background_done
                    self.wanted.clear()
                    self.wanted_at.clear()
                    self.unstored.clear()  # left to JAX's cache
                    self._stop = True  # for good: `want` asks no more
                    return None
                if self.wanted:
                    key = self.wanted.popleft()
                    self.wanted_at.pop(key, None)
                    return key
                if keys:
                    return keys.popleft()
                if self.unstored:
                    with self.lock:
                        self.storing += 1
                    return ("store", self.unstored.popleft())
            return None

        def run():
            nonlocal listed
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            while (key := next_key()) is not None:
                if key[0] == "store":
                    try:
                        self.store_again(key[1])
                    finally:
                        with self.lock:
                            self.storing -= 1
                    continue
                if key not in self._table():
                    try:
                        prog = self.compile(key)
                        self.memory.background += 1
                        if worth_exercising(key):
                            with self.sched.lock:  # the scheduler thread runs it once at its next idle moment
                                self.fresh.append((key, prog))
                                self.sched.wake.notify()
                    except Exception:
                        logger.exception("background compile of %s failed", key)
                with self.lock:
                    self.background_done += 1
                if listed and not keys:
                    logger.info("compiled %d background programs in %.0f s", listed, time.perf_counter() - t)
                    listed = 0

        self._thread = threading.Thread(target=run, name="jaxspec-compile", daemon=True)
        self._thread.start()

    def _over_budget(self, left: int) -> None:
        """Stops background compiling for good: the compiled programs fill even the room wanted
        programs have (WANTED_MEMORY times their budget)."""
        m = self.memory
        logger.warning(
            "background compiles stopped for good after %d programs, %d left: %d compiled programs take about %.2f "
            "GiB, and programs calls ask for may take %.2f GiB (%d times their budget of a tenth of host RAM, at most "
            "2.5 GiB); the shapes left are served by larger programs",
            self.background_done,
            left,
            m.count,
            m.bytes / 2**30,
            WANTED_MEMORY * m.budget_bytes / 2**30,
            WANTED_MEMORY,
        )
        with self.lock:
            self.background_total = self.background_done
        self.wanted.clear()
        self.wanted_at.clear()
        self.unstored.clear()
        self._stop = True

    def store_again(self, key: tuple) -> None:
        """Compiles `key` once more, past JAX's cache, and stores it for the next start (it came
        from JAX's cache, which XLA:CPU cannot serialize again; server/program_store.py)."""
        store = self._store
        if store is None:
            return
        try:
            prog, fresh = compile_again(self._lower(key))
            if fresh:
                store.save(key, prog)
            del prog
            trim_heap()
        except Exception:
            logger.exception("compiling %s again to store it failed", key)

    def stop(self) -> None:
        self._stop = True

    # ---- lookup --------------------------------------------------------------------------------

    def _have(self) -> list[tuple]:
        tbl = self._table()
        with self.lock:
            return list(tbl)

    def get(self, key: tuple) -> Callable:
        """The compiled program for exactly `key`, compiling it now if needed (counted). On node 0
        of several hosts, calling it also runs it on the other nodes (server/nodes.py)."""
        prog = self.get_local(key)
        nodes = self.sched.nodes
        return prog if nodes is None else functools.partial(nodes.run, key, prog)

    def get_local(self, key: tuple) -> Callable:
        """get's program, run on this process alone."""
        tbl = self._table()
        with self.lock:
            prog = tbl.get(key)
        if prog is None:
            if not self.lazy:
                logger.warning("no compiled program covers %s: compiling it now (this request waits)", key)
            self.compiles_on_demand += 1
            prog = self.compile(key)
        return prog

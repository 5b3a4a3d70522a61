"""The server's compiled device programs, by shape, compiled ahead of time, and the rule that picks one.

The scheduler runs four programs (jaxspec/serving.py), each specialised on a few static sizes:

  ("chunk", n, C, span)     admit_chunk: one prefill chunk of C tokens for n new requests
  ("finish", n)             admit_finish: their first tokens (its draft extension reads every column)
  ("copy",)                 copy_prefix: a cached prompt prefix's KV columns into a new
                            request's slot (prefix caching)
  ("dispatch", n_act, span, sampled, shape, logprobs, grammar)
                            dispatch: k rounds for slots [0, n_act); sampled=False is a
                            greedy-only program (no sampler), True serves any mix; shape: the
                            tree shape's label (speculative/adaptive.py shape_label; "off" is
                            plain decoding), the configured one or another candidate of
                            adaptive speculation (a shallower tree, or plain steps);
                            logprobs=True also computes the emitted tokens' logprobs (for
                            requests that ask; it serves the others too, a little slower);
                            grammar=True masks tokens by constrained requests' grammars (host
                            callbacks, jaxspec/grammar.py); only such dispatches use it

`span` is how many KV columns attention reads: one of `spans()` (64, 256, 1024, .. up to the
context on a CPU). A program for a larger n_act, C or span than a call needs is still correct (extra slots are stopped, extra columns are masked, a chunk is zero-padded),
only slower, and a sampled=True dispatch serves greedy slots too (on CPU at no extra cost: its
sampler is skipped for a call with no drawing slot, jaxspec/sampling.py SKIP_UNUSED, so there
no greedy-only programs are compiled ahead). So no request has to wait for
XLA: start-up compiles a *cover* set that serves any request within --context-length and
--max-running-requests (`startup_keys`: prefill at every span, decoding at every span for one
slot and for all of them, all sampled=True, one logprobs=True program at the largest shape, and two
logprobs=True grammar=True programs for constrained requests, at the largest short span and the
largest), a background thread then
compiles every other shape (most useful first: with adaptive speculation, the twins of the
start-up dispatches for its other candidates, then the greedy-only twins of the start-up
dispatches; with the persistent compilation cache, a restart loads them from disk: as JAX
serialized them, without tracing, from server/program_store.py, else from JAX's cache), and
each call takes the cheapest program compiled so far that covers it (adaptive speculation runs
another candidate only once a program of that candidate covers the call). A call served through a
larger program asks for its own (`want`; the scheduler asks for the configured shape's and plain
steps', and a prefill served by larger chunks or from an earlier position for the ideal chunks),
which the background thread compiles before the rest of its list (on a CPU, where
background compiles wait for a quiet moment, also under steady load once it has waited
WANTED_WAIT). Only with --disable-cuda-graph (nothing compiled ahead) does a call compile on first use.

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
from jaxspec.requests import bucket
from jaxspec.sampling import SamplingTensors, skips_unused
from jaxspec.server.exercise import exercise, worth_exercising
from jaxspec.server.memory import WANTED_MEMORY, ProgramMemory, map_usage, program_budget, trim_heap
from jaxspec.server.program_store import ProgramStore, compile_again, compile_fresh, store_path
from jaxspec.serving import admit_chunk, admit_finish, copy_prefix, dispatch
from jaxspec.speculative.adaptive import OFF
from jaxspec.weights import Models

logger = logging.getLogger("jaxspec.server")

SHORT_CHUNK = 64  # the smallest prefill chunk (or --chunked-prefill-size if smaller)
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


def chunk_cost(key: tuple) -> float:
    """A prefill chunk program's relative cost, ("chunk", n, C, span) -> n x C x (1 + span / 2048):
    its rows through the weights plus attention over the span (two SmolLM2 chunks on the 2-core CPU:
    C = 64 at span 64 took 117 ms, C = 512 at span 1024 1,240 ms)."""
    return key[1] * key[2] * (1 + key[3] / 2048)


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


class Programs:
    """Compiled programs of one Scheduler, keyed as in the module docstring."""

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

    # ---- shapes --------------------------------------------------------------------------------

    def spans(self) -> list[int]:
        """The KV spans programs are compiled for: min_span times powers of four, then max_len (the
        context plus the round's scratch columns), which replaces the span just below it when it
        is within a quarter of it (a context of 8192 reads 8256 columns: one set of programs for
        both, not two). Steps of four, not two: half as many programs, each a few tens of MB of
        host memory on a CPU, for attention over at most 4x the columns a call needs (the weights,
        read once per step whatever the span, dominate short spans)."""
        s = self.sched
        out, x = [], s.min_span
        while x < s.max_len:
            out.append(x)
            x *= 4
        if len(out) > 1 and s.max_len * 4 <= out[-1] * 5:
            out.pop()
        return out + [s.max_len]

    def span_for(self, need: int) -> int:
        """The smallest of spans() that is >= need (max_len for anything longer)."""
        return next((x for x in self.spans() if x >= need), self.sched.max_len)

    def sizes(self, up_to: int | None = None) -> list[int]:
        cap = min(up_to or self.sched.slots, self.sched.slots)
        out, n = [], 1
        while n <= cap:
            out.append(n)
            n *= 2
        if self.sched.slots not in out and up_to is None:
            out.append(self.sched.slots)
        return out

    def chunk_sizes(self) -> list[int]:
        """Prefill chunk sizes: powers of two from min(64, top) to top = --chunked-prefill-size rounded up."""
        top = bucket(self.sched.eng.chunked_prefill_size)
        out, c = [], min(SHORT_CHUNK, top)
        while c <= top:
            out.append(c)
            c *= 2
        return out

    def chunk_for(self, span: int) -> int:
        """The prefill chunk whose programs are compiled at `span`: prompts of up to the top chunk are
        prefilled in one chunk of their own power of two, longer ones in top-size chunks."""
        return min(span, self.chunk_sizes()[-1])

    def startup_keys(self, max_bs: int) -> list[tuple]:
        """The cover set: every prompt length's prefill (for one request at a time; the uncached
        tail of a prompt whose prefix is cached too), decoding at every span for batch sizes 1, 2,
        4, .. up to max_bs and for all the slots (a call of n_act slots runs the smallest of them
        >= n_act), and with adaptive speculation plain steps for all the slots at spans up to 1024
        (where a busy server turns speculation off). With prefix caching, the prefix copy.
        At the short spans (chat prompts) a prompt is prefilled by its own chunk, not by the span's
        largest: each chunk size longer than the span below, and with prefix caching the smallest
        (a cached prompt's tail). Through the largest, a 65-128-token prompt took 200 ms to its
        first dispatch instead of 70, in a server whose background compiles had stopped before
        compiling its own."""
        s = self.sched
        spans = self.spans()
        short = [x for x in spans if x <= 512] or spans[:1]
        keys: list[tuple] = [("finish", 1)]
        keys += [("chunk", 1, self.chunk_for(x), x) for x in spans]
        sizes = self.chunk_sizes()
        tail = sizes[0] if s.cache.enabled else None
        for below, x in zip([0, *short], short):
            keys += [("chunk", 1, c, x) for c in sizes if c <= self.chunk_for(x) and (c > below or c == tail)]
        if s.cache.enabled:
            keys.append(("copy",))
        main = s.main_shape
        for n in sorted(set(self.sizes(max_bs)) | {s.slots}):
            keys += [("dispatch", n, x, True, main, False, False) for x in spans]
        if OFF in s.shapes and OFF != main:
            keys += [("dispatch", s.slots, x, True, OFF, False, False) for x in spans if x <= 1024]
        keys.append(
            ("dispatch", s.slots, s.max_len, True, main, True, False)
        )  # covers every request asking for logprobs
        if s.grammar:  # constrained requests (with or without logprobs): short ones, and every other
            keys += [("dispatch", s.slots, x, True, main, True, True) for x in (short[-1], s.max_len)]
        return list(dict.fromkeys(keys))

    def background_keys(self) -> list[tuple]:
        """Every other shape, most useful first: one request at every span, then every batch size,
        then admission of several requests at once (bursts of short prompts). With adaptive
        speculation, the twins of the start-up dispatches for plain steps come first (without them
        it cannot choose), then the smallest prefill chunk at every span (a cached prompt's tail),
        then the twins for the shallower tree and the greedy-only twins of the start-up dispatches
        (none on CPU, see the module docstring); the twins of the others come last, and the
        logprob programs for one request at each short span after them. The list may be cut short
        by MAP_BUDGET or the program memory budget, so the most useful come first."""
        spans, sizes, main = self.spans(), self.sizes(), self.sched.main_shape
        startup = [k for k in self.startup_keys(self.startup_bs) if k[0] != "dispatch" or not k[5]]
        # greedy-only twins: not where the sampling programs skip their sampler for greedy calls (CPU)
        greedy = lambda ks: [] if skips_unused() else [k[:3] + (False,) + k[4:] for k in ks if k[0] == "dispatch"]
        others = [x for x in reversed(self.sched.shapes) if x != main]  # plain steps, then shallower trees
        twins = lambda ks, shapes=others: [k[:4] + (x,) + k[5:] for x in shapes for k in ks if k[0] == "dispatch"]
        # plain steps' twins first (adaptive speculation cannot choose without them), then the
        # smallest chunk at every span (a cached prompt's tail: multi-turn chats), then the
        # shallower trees' twins, which adaptive speculation chooses least often
        keys = twins(startup, others[:1])
        if self.sched.cache.enabled:
            keys += [("chunk", 1, self.chunk_sizes()[0], x) for x in spans]
        keys += twins(startup, others[1:]) + greedy(startup)
        rest = [("dispatch", 1, x, True, main, False, False) for x in spans]
        rest += [("dispatch", n, x, True, main, False, False) for x in spans for n in sizes]
        keys += rest
        # tiny prompts under a large min span
        keys += [("chunk", 1, c, spans[0]) for c in self.chunk_sizes() if c < spans[0]]
        for n in sizes[1:]:
            keys.append(("finish", n))
            keys += [("chunk", n, self.chunk_for(x), x) for x in spans if x <= 512]
        keys += greedy(rest)
        keys += twins(greedy(startup) + rest + greedy(rest))
        keys += [("dispatch", 1, x, True, main, True, False) for x in spans if x <= 512]
        return [k for k in dict.fromkeys(keys) if k not in self._have()]

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

    # ---- choosing ------------------------------------------------------------------------------

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

    def dispatch_key(
        self,
        n_act: int,
        span: int,
        sampled: bool = True,
        shape: str | None = None,
        logprobs: bool = False,
        grammar: bool = False,
    ) -> tuple | None:
        """The cheapest compiled ("dispatch", n', span', s', shape, l') with n' >= n_act, span' >= span,
        s' >= sampled (a sampling program serves greedy slots, at the cost of its sampler) and
        l' >= logprobs, and grammar as asked. shape: a label of sched.shapes (default: the configured one). When no
        compiled program covers the call: the exact key for the configured shape (compiled now;
        a sampling one on CPU, where it serves greedy calls as fast, except with --disable-cuda-graph,
        where each call compiles its own kind: a greedy-only program compiles faster), None for
        another candidate of adaptive speculation (the configured shape serves the call instead)."""
        shape = self.sched.main_shape if shape is None else shape
        exact = ("dispatch", n_act, span, sampled or (skips_unused() and not self.lazy), shape, logprobs, grammar)
        have = [
            k
            for k in self._have()
            if k[0] == "dispatch"
            and k[1] >= n_act
            and k[2] >= span
            and k[3] >= sampled
            and k[4] == shape
            and k[5] >= logprobs
            and k[6] == grammar
        ]
        if self.lazy or exact in have:
            return exact
        if not have:
            return exact if shape == self.sched.main_shape else None
        return min(have, key=lambda k: (k[5], k[1] * (1024 + k[2]), k[3]))

    def finish_sizes(self) -> list[int]:
        return sorted(k[1] for k in self._have() if k[0] == "finish")

    def prefill_plan(
        self, n: int, length: int, exact: bool = False, start: int = 0
    ) -> tuple[int, int, list[tuple]] | None:
        """(C, first position, chunk keys) to prefill positions [start, length) of n prompts of at
        most `length` tokens (those before `start` are cached), or None if no compiled programs do
        it. exact (or a lazy store): the ideal chunk (the power of two of the positions left, at
        most the prefill chunk size) from `start`, compiled or not. Otherwise compiled programs
        from `start`, the last chunk padded past `length`: the ideal chunk, else the smallest
        chunks, each at the smallest span compiled; or, where it is cheaper by chunk_cost, chunks
        from an earlier position, recomputing cached positions so that programs of a shorter span
        serve (a cached prompt's last token: one small chunk from the start of the KV region
        rather than a long chunk over a long span, when the small chunk at the long span is not
        compiled). Chunks never run past the KV region (they start earlier instead)."""
        s = self.sched
        sizes = self.chunk_sizes()
        ideal = min(sizes[-1], max(sizes[0], bucket(length - start)))
        have = {k for k in self._have() if k[0] == "chunk" and k[1] == n}
        spans = sorted({k[3] for k in have})

        def plan(c: int, first: int) -> tuple[float, int, int, list[tuple]] | None:
            """(cost, C, first position, keys) of chunks of C from `first` (earlier where they would
            run past the KV region), or None where a chunk has no compiled program."""
            count = -(-(length - first) // c)
            first = max(0, min(first, s.max_len - count * c))
            keys = []
            for i in range(count):
                need = s._span(first + i * c + c)
                if self.lazy or exact:
                    keys.append(("chunk", n, c, need))
                    continue
                cands = [k for k in have if k[2] == c and k[3] >= need]
                if not cands:
                    return None
                keys.append(min(cands, key=lambda k: k[3]))
            return sum(map(chunk_cost, keys)), c, first, keys

        if self.lazy or exact:
            return plan(ideal, start)[1:]  # type: ignore[index]  # (never None here)
        best = None
        for c in [ideal] + [c for c in sorted({k[2] for k in have}) if c != ideal]:  # from `start`
            best = plan(c, start)
            if best is not None:
                break
        for c in sorted({k[2] for k in have}):  # from earlier, where that is cheaper
            count = -(-(length - start) // c)
            # the latest start first: on a tie, fewer cached positions recomputed
            for first in sorted({min(start, x - m * c) for x in spans for m in range(1, count + 1)}, reverse=True):
                alt = plan(c, first) if 0 <= first < start else None
                if alt is not None and (best is None or alt[0] < best[0]):
                    best = alt
        return None if best is None else best[1:]

"""Online draft training: an EAGLE-3 head that learns from the traffic it serves
(`speculative_online_train`, `--speculative-online-train`).

Every finished request goes into a bounded buffer (every HOLDOUT-th one is held back instead, for
scoring): its last MAX_LEN tokens and the target's features at their positions, read back from
the draft cache, where serving kept them (EagleProposer.keep_features): verification computed
them already, so training runs no target forward. A background thread (of the serving process, or
of a training process of its own: online_process.py, the default on the CPU) trains a copy of the head
in use with `train-draft`'s EAGLE-3 training-time-test loss (jaxspec/train/trainer.py) on
batches drawn from the buffer, the labels being the tokens served (the target's own: its argmax
at temperature 0, its samples otherwise). It spends at most `speculative_online_train_share` of
the time training (it sleeps the rest; OnlineTrainer.clock), so serving keeps the other share. Every
`speculative_online_train_swap_every` steps it scores the copy and the weights in use on the
held-back slice by the accept length a chain of the tree's depth would get from their per-depth
top-1 agreement with the served tokens:
    1 + a_0 + a_0 a_1 + ... + a_0 ... a_{k-1}.
The held-back requests are scored in fixed groups of BATCH by arrival, so the weights in use, which
change only at a swap, score each full group once: later scorings reuse it and score only the copy.
The copy's draft vocabulary follows the traffic too (vocab.retarget): at the start and after every
score, tokens the buffered outputs use at least VOCAB_MIN_COUNT times that the vocabulary lacks (a
token outside it can never be drafted) take the places of tokens no buffered output uses, at most
VOCAB_STEP at a time; their LM-head rows start as the target's rows through the linear map the head's
own rows fit (vocab.mapped_rows) and are trained from there. The size stays, so nothing recompiles.
When the copy scores higher, it is written in the public EAGLE-3 layout and loaded like any draft,
and the engine's draft weights are replaced between dispatches (`Engine.swap_draft`). The programs
take the draft's weights as arguments of the same shapes, so nothing recompiles.

Whatever the draft proposes, verification decides every token, so output is unchanged by
construction: a swap can change only how many tokens a round accepts. A training step whose loss
is not finite, or that raises (out of memory included), is logged, counted and dropped: the copy
goes back to the weights in use, and serving goes on with them.

Limits: EAGLE-3 heads, on a target served unquantized (its features must be the float ones the
head was trained on), one process (not under tensor parallelism or several replicas).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.speculative.proposers.eagle import unpack_features

logger = logging.getLogger(__name__)
HOLDOUT = 5  # every HOLDOUT-th finished request is held back for scoring
HOLDOUT_MAX = 64  # scoring uses the most recent this many held-back requests
MIN_EXAMPLES = 16  # training starts once the buffer holds this many requests
BATCH = 8  # requests per training step
MAX_LEN = 512  # tokens per training sequence (longer requests are cut)
VOCAB_STEP = 128  # draft-vocabulary tokens replaced at most per revision
VOCAB_MIN_COUNT = 3  # a token enters the draft vocabulary once the buffered outputs hold it this often


def feature_window(total: int, cols: int) -> tuple[int, int]:
    """Where to read a finished request's features from a slot of `cols` cache columns: (first
    column, columns) of a fixed-size read covering the positions training uses, [max(0, total -
    MAX_LEN), total - 2) for a request of `total` tokens."""
    size = min(MAX_LEN, cols)
    return min(max(0, total - MAX_LEN), cols - size), size


@functools.partial(jax.jit, static_argnames=("size",))
def read_features(layer, slot, first, size: int):
    """Columns [first, first + size) of one slot of the draft cache's feature layer [B, S, 1, F]
    -> [size, F] bfloat16. A read-only program: the cache is not donated, later writes wait for it."""
    f = layer.shape[-1]
    return unpack_features(jax.lax.dynamic_slice(layer, (slot, first, 0, 0), (1, size, 1, f))[0, :, 0])


@dataclasses.dataclass
class Served:
    """A finished request as online training keeps it: ids [n] (its last MAX_LEN tokens), mask [n]
    (1 at output tokens) and the target features at its first n - 2 positions (the draft's input at
    the rows that have a token two ahead): rows `row` .. `row` + n - 2 of `feats`, an array
    still being computed when it arrives, [n - 2, F] on the host once the training thread has
    read it."""

    ids: np.ndarray
    mask: np.ndarray
    feats: Any
    row: int = 0
    held_at: int = -1  # its place among held-back requests (scoring batches group by it), -1 if trained on

    def features(self) -> np.ndarray:
        """[n - 2, F] on the host (waits for the read the first time). The rows are cut on the host:
        a device slice would compile a program for every request length."""
        n = len(self.ids) - 2
        if self.row or not isinstance(self.feats, np.ndarray) or len(self.feats) != n:
            self.feats, self.row = np.asarray(jax.device_get(self.feats))[self.row : self.row + n].copy(), 0
        return self.feats


def served(prompt_ids: list[int], output_ids: list[int], feats, first: int = 0) -> Served | None:
    """A finished request as online training keeps it (OnlineTrainer.observe's arguments), or None
    when it has nothing to learn from (no output, or fewer than 3 tokens)."""
    if not output_ids or len(prompt_ids) + len(output_ids) < 3:
        return None
    ids = [int(t) for t in prompt_ids] + [int(t) for t in output_ids]
    start = max(0, len(ids) - MAX_LEN)
    mask = [0] * len(prompt_ids) + [1] * len(output_ids)
    return Served(np.asarray(ids[start:], np.int32), np.asarray(mask[start:], np.float32), feats, start - first)


def pad_served(recs: list[Served], length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> ids [B, length] int32, mask [B, length] float32, feats [B, length, F] (0 on padding)."""
    fs = [r.features() for r in recs]
    ids = np.zeros((len(recs), length), np.int32)
    mask = np.zeros((len(recs), length), np.float32)
    feats = np.zeros((len(recs), length, fs[0].shape[-1]), fs[0].dtype)
    for i, (r, f) in enumerate(zip(recs, fs)):
        ids[i, : len(r.ids)] = r.ids
        mask[i, : len(r.mask)] = r.mask
        feats[i, : len(f)] = f
    return ids, mask, feats


def query_rows(recs: list[Served], length: int, depth: int) -> tuple[np.ndarray | None, int | None]:
    """The rows a training-time test of `depth` steps scores in a batch padded to `length`: per
    request from `depth` + 1 rows before its first output token to its end. -> (first row [B],
    rows Q: a power of two, at least 32) for losses.eagle3_ttt_loss, or (None, None) when Q would
    be every row."""
    first = np.asarray([max(0, int(np.argmax(r.mask > 0)) - depth - 1) for r in recs], np.int32)
    need = max(len(r.ids) - 2 - f for r, f in zip(recs, first))
    nq = max(32, 1 << (max(int(need), 1) - 1).bit_length())
    return (None, None) if nq >= length - 1 else (first, nq)


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
    buffer: int = 512  # requests kept for training (the oldest dropped first)
    lr: float = 3e-4
    share: float = 0.25  # at most this share of the time spent training (OnlineTrainer.clock)
    swap_every: int = 20  # training steps between scores (and swaps)
    save: str | None = None  # write the head here at every swap
    process: bool | None = None  # train in a second process (online_process.py); None: on the CPU

    @classmethod
    def from_args(cls, args) -> OnlineConfig:
        return cls(
            buffer=args.speculative_online_train_buffer,
            lr=args.speculative_online_train_lr,
            share=args.speculative_online_train_share,
            swap_every=args.speculative_online_train_swap_every,
            save=args.speculative_online_train_save,
            process=args.speculative_online_train_process,
        )


def expected_accept(acc: list[float]) -> float:
    """A chain's expected tokens per round from per-depth top-1 agreement (1 = the bonus token)."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def check(engine, cfg: OnlineConfig) -> None:
    """Refuses a draft, a target or settings online training cannot work with (JaxspecError)."""
    spec = engine.spec
    if spec.algorithm != "EAGLE3":
        raise JaxspecError(
            f"speculative_online_train trains EAGLE-3 heads; the draft here is {spec.algorithm} "
            "(use --speculative-algorithm EAGLE3)"
        )
    if engine.quantization is not None or engine.tp_size > 1:
        raise JaxspecError(
            "speculative_online_train needs an unquantized target on one device (the head learns from the "
            "target's float features)"
        )
    if not 0 < cfg.share <= 1 or cfg.buffer < MIN_EXAMPLES or cfg.swap_every < 1 or not cfg.lr > 0:
        raise JaxspecError(
            f"speculative_online_train: share must be in (0, 1], buffer >= {MIN_EXAMPLES}, swap_every >= 1 "
            f"and lr > 0 (got {cfg.share}, {cfg.buffer}, {cfg.swap_every}, {cfg.lr})"
        )


# stats() before any training (the training process's first report)
NO_STATS = {
    "draft_version": 0,
    "online_train_steps": 0,
    "online_train_failed_steps": 0,
    "online_train_vocab_replaced": 0,
    "online_train_buffer": 0,
    "online_train_held_out": 0,
    "online_train_score_in_use": None,
    "online_train_score_candidate": None,
    "online_train_last_swap": None,
}


def copy_head(src: str, dst: str) -> str:
    """Copies the head at `src` (public EAGLE-3 layout) to `dst`; returns dst. A fresh engine loads
    it with --speculative-draft-model-path."""
    os.makedirs(dst, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


def cpu_seconds() -> float:
    """CPU time this process has used, over the machine's cores: seconds of the whole machine."""
    return time.process_time() / (os.cpu_count() or 1)


class OnlineTrainer:
    """The buffer, the background training thread and the swap, for one engine (or, in the training
    process, for online_process's stand-in for it).

    out_dir: where swapped-in heads are written (default: a temporary folder removed at exit);
    on_change: called with stats() after every step and scoring; prune: remove the previous
    swapped-in head at a swap (the training process leaves that to the serving one, which may
    still be reading it); clock: the seconds the share counts (wall time; the training process
    counts its CPU time over the machine's, cpu_seconds, since serving has the CPU first)."""

    def __init__(self, engine, cfg: OnlineConfig, out_dir: str | None = None, on_change=None, prune=True, clock=None):
        check(engine, cfg)
        spec = engine.spec
        self.engine, self.cfg = engine, cfg
        self.on_change, self.prune = on_change, prune
        self.clock = clock or time.monotonic
        self.depth = max(2, min(spec.num_steps, 7))  # TTT depth = the chain's depth the score assumes
        self.head_path = spec.draft_model_path  # the head in use, in the public layout
        self.examples: collections.deque = collections.deque(maxlen=cfg.buffer)
        self.held: collections.deque = collections.deque(maxlen=HOLDOUT_MAX)
        self.lock = threading.Lock()
        self.seen = 0
        self.version = 0  # swaps so far: the head in use is version `version`
        self.steps = 0
        self.failed_steps = 0
        self.vocab_replaced = 0  # draft-vocabulary tokens replaced so far (revise_vocab)
        self._served_vocab: Any = None  # the draft vocabulary of the weights in use [Vd]
        self.last_score: dict | None = None  # the last scoring: step, score in use, score of the copy, swapped
        self.last_swap: dict | None = None  # the scoring that swapped the head in use in (the same keys)
        self._trainer: Any = None
        self._served: Any = None  # the weights in use, in the trainer's layout
        self._rng = np.random.default_rng(0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dir = out_dir or ""  # where swapped-in heads are written (default: made with the trainer)
        self._held_count = 0  # requests held back so far
        self._in_use_scores: dict = {}  # (version, held_at of a group) -> the weights in use's agreement on it

    # ---- traffic --------------------------------------------------------------------------------

    def observe(self, prompt_ids: list[int], output_ids: list[int], feats, first: int = 0) -> None:
        """A finished request: into the training buffer or the held-back slice. feats: the target
        features serving kept for it (row j: position first + j; at least the positions
        [max(0, n - MAX_LEN), n - 2) of its n tokens), a device array whose computation may still
        be running (it is read by the training thread). Never blocks on training or the device."""
        rec = served(prompt_ids, output_ids, feats, first)
        if rec is not None:
            self.add(rec)

    def add(self, rec: Served) -> None:
        """A finished request, as Served: into the training buffer or the held-back slice; starts the
        training thread once there is enough to train on."""
        with self.lock:
            self.seen += 1
            if self.seen % HOLDOUT == 0:
                rec.held_at = self._held_count
                self._held_count += 1
                self.held.append(rec)
            else:
                self.examples.append(rec)
            ready = len(self.examples) >= MIN_EXAMPLES and len(self.held) >= 2
        if ready and self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="jaxspec-online-train", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def stats(self) -> dict:
        """What /get_server_info and /metrics show."""
        with self.lock:
            last = self.last_score
            return {
                "draft_version": self.version,
                "online_train_steps": self.steps,
                "online_train_failed_steps": self.failed_steps,
                "online_train_vocab_replaced": self.vocab_replaced,
                "online_train_buffer": len(self.examples),
                "online_train_held_out": len(self.held),
                "online_train_score_in_use": None if last is None else last["in_use"],
                "online_train_score_candidate": None if last is None else last["candidate"],
                "online_train_last_swap": self.last_swap,
            }

    def close(self) -> None:
        """Stops the training thread and waits for its step to end (a thread killed inside XLA at
        interpreter exit aborts the process)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=120)

    # ---- training -------------------------------------------------------------------------------

    def _build(self):
        from jaxspec.train.trainer import TrainConfig, Trainer

        cfg = TrainConfig(
            algorithm="EAGLE3", steps=10**9, batch_size=BATCH, max_len=MAX_LEN, lr=self.cfg.lr, warmup=0,
            ttt_steps=self.depth, save_every=10**9,
        )  # fmt: skip
        from jaxspec.train.data import Example

        with self.lock:
            examples = [Example(list(r.ids), list(r.mask)) for r in self.examples]
        tcfg = _head_config(self.head_path)
        if not self._dir:
            self._dir = tempfile.mkdtemp(prefix="jaxspec-online-")
            atexit.register(shutil.rmtree, self._dir, True)
        tr = Trainer(self.engine.loaded, tcfg, examples, cfg, self._dir, progress=False, init_head=self.head_path)
        self._served = jax.tree.map(jnp.copy, tr.params)
        self._served_vocab = np.asarray(tr.ids)
        return tr

    def revise_vocab(self) -> int:
        """Turns the copy's draft vocabulary towards the buffered outputs (module docstring);
        returns how many tokens were replaced."""
        from jaxspec.train.trainer import output_rows
        from jaxspec.train.vocab import mapped_rows, retarget, token_counts

        tr = self._trainer
        with self.lock:
            outputs = [r.ids[r.mask > 0] for r in self.examples]
        cfg = self.engine.loaded.cfg
        counts = token_counts(outputs, cfg.vocab_size)
        vocab, src = retarget(tr.ids, counts, VOCAB_STEP, VOCAB_MIN_COUNT, keep=cfg.eos_token_ids)
        added = int((src < 0).sum())
        if added:
            lm = np.asarray(jax.device_get(tr.params["lm_head"]["kernel"][...])).T  # [Vd, H]
            rows = mapped_rows(lm, tr.ids, np.asarray(output_rows(self.engine.loaded.model)), vocab[src < 0])
            tr.set_vocab(vocab, src, rows)
            with self.lock:
                self.vocab_replaced += added
            logger.info("online draft training: %d tokens of the traffic entered the draft vocabulary", added)
        return added

    def _run(self) -> None:
        try:
            self._trainer = self._build()
        except Exception:
            logger.exception("online draft training could not start; serving goes on with the draft as it is")
            return
        scored = 0  # the step count at the last scoring (a dropped step leaves the count as it was)
        self._revise_vocab_logged()
        while not self._stop.is_set():  # the buffer holds at least MIN_EXAMPLES requests from here on
            t0, w0 = self.clock(), time.monotonic()
            self.train_steps(1)
            if self.steps - scored >= self.cfg.swap_every:
                scored = self.steps
                self.score_and_swap()
                self._revise_vocab_logged()
            self.report()
            # the serving share: training took `spent` of the clock; wait until that is `share` of the time
            spent = self.clock() - t0
            self._stop.wait(max(0.0, spent / self.cfg.share - (time.monotonic() - w0)))

    def report(self) -> None:
        """Hands stats() to on_change (the training process sends them to the serving one)."""
        if self.on_change is not None:
            self.on_change(self.stats())

    def _revise_vocab_logged(self) -> None:
        try:
            self.revise_vocab()
        except Exception:  # the vocabulary stays as it was; training goes on
            logger.exception("online draft training: the draft vocabulary could not be revised")

    def train_steps(self, n: int) -> None:
        """n updates of the copy on batches drawn from the buffer (failures dropped and counted)."""
        tr = self._trainer or self._build()
        self._trainer = tr
        for _ in range(n):
            with self.lock:
                pool = list(self.examples)
                held = list(self.held)
            for r in pool + held:  # the reads that arrived: onto the host, cut to the rows used
                r.features()
            batch = [pool[i] for i in self._rng.choice(len(pool), size=min(BATCH, len(pool)), replace=False)]
            backup = jax.tree.map(jnp.copy, (tr.params, tr.opt_state))  # the update donates its inputs
            try:
                args, nq = self._batch(tr, batch)
                lr = jnp.float32(self.cfg.lr)
                params, opt, loss, _ = tr.update_given(
                    tr.params, tr.opt_state, tr.rest, tr._tgt_params, lr, *args, nq=nq, vocab=jnp.asarray(tr.ids)
                )
                if not math.isfinite(float(loss)):
                    raise FloatingPointError(f"loss {float(loss)}")
                tr.params, tr.opt_state = params, opt
                with self.lock:
                    self.steps += 1
            except Exception as e:  # NaN, out of memory: drop the step, keep the weights
                tr.params, tr.opt_state = backup
                with self.lock:
                    self.failed_steps += 1
                logger.warning("online draft training step dropped (%s); the weights stay as they were", e)

    def score_and_swap(self) -> bool:
        """Scores the copy and the weights in use on the held-back slice; swaps when the copy is better."""
        tr = self._trainer
        with self.lock:
            held = list(self.held)
        if tr is None or not held:
            return False
        candidate = tr.params
        (in_use, cand), cand_groups = self._scores(
            tr, held, ((self._served, self._served_vocab), (candidate, tr.ids)), cache=self._in_use_scores
        )
        swap = cand > in_use
        if swap:
            self._swap_in(candidate)
            # the copy just scored is the head in use now: its agreement stands for the new version
            self._in_use_scores = {(self.version, g): a for g, a in cand_groups.items()}
        with self.lock:
            self.last_score = {"step": self.steps, "in_use": in_use, "candidate": cand, "swapped": swap}
            if swap:
                self.last_swap = self.last_score
        logger.info(
            "online draft training: step %d, score in use %.3f, candidate %.3f%s",
            self.steps, in_use, cand, " (swapped in)" if swap else "",
        )  # fmt: skip
        return swap

    def _scores(self, tr, held: list[Served], heads: tuple, cache: dict | None = None) -> tuple[list[float], dict]:
        """Each head's expected accept length on `held`, in groups of BATCH by arrival (held_at //
        BATCH), each padded to its length bucket. heads: (params, draft vocabulary [Vd]) pairs.
        cache: where the first head's agreement on a full group is kept, by (version, group), and
        taken from when the same group is scored again at the same version (the first head must be
        the weights in use); entries for groups no longer held or older versions are dropped.
        -> (each head's score, the last head's agreement [depth] on each full group, by group)."""
        groups: dict[int, list[Served]] = {}
        for r in held:
            groups.setdefault(r.held_at // BATCH, []).append(r)
        sums = [np.zeros(self.depth) for _ in heads]
        kept, last = {}, {}
        for g, recs in groups.items():
            key = (self.version, g)
            hit = cache.get(key) if cache is not None and len(recs) == BATCH else None
            args, nq = self._batch(tr, recs)
            for i, (acc, (params, vocab)) in enumerate(zip(sums, heads)):
                if i == 0 and hit is not None:
                    a = hit
                else:
                    _, m = tr.eval_given(params, tr.rest, tr._tgt_params, *args, nq=nq, vocab=jnp.asarray(vocab))
                    a = np.asarray([float(m[f"acc_{j}"]) for j in range(self.depth)])
                if i == 0 and len(recs) == BATCH:
                    kept[key] = a
                if i == len(heads) - 1 and len(recs) == BATCH:
                    last[g] = a
                acc += a
        if cache is not None:
            cache.clear()
            cache.update(kept)
        return [float(expected_accept(list(acc / max(len(groups), 1)))) for acc in sums], last

    def _batch(self, tr, recs: list[Served]) -> tuple[tuple, int | None]:
        """((ids, mask, feats, first row or None) on the device, rows Q or None) for the trainer's
        update_given / eval_given: recs padded to their length bucket, the rows scored chosen
        (query_rows)."""
        length = tr._padded_len(max(len(r.ids) for r in recs))
        ids, mask, feats = pad_served(recs, length)
        first, nq = query_rows(recs, length, self.depth)
        return (
            jnp.asarray(ids),
            jnp.asarray(mask),
            jnp.asarray(feats),
            None if first is None else jnp.asarray(first),
        ), nq

    def _swap_in(self, params) -> None:
        tr = self._trainer
        path = os.path.join(self._dir, f"v{self.version + 1}")
        os.makedirs(path, exist_ok=True)
        tr.out = path
        tr.params = params
        tr.export("float32")
        self.engine.swap_draft(path)
        self._served = jax.tree.map(jnp.copy, params)
        self._served_vocab = np.asarray(tr.ids)
        old, self.head_path = self.head_path, path
        if self.prune and os.path.dirname(old) == self._dir:  # an earlier swapped-in head: only the one in use is kept
            shutil.rmtree(old, ignore_errors=True)
        with self.lock:
            self.version += 1
        if self.cfg.save:
            self.save(self.cfg.save)

    def save(self, path: str) -> str:
        """Writes the head in use to `path` (copy_head); returns it."""
        return copy_head(self.head_path, path)


def _head_config(path: str) -> dict:
    """The served head's config.json: its target fields (sizes, RoPE, token ids) are the target's."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)

"""Online draft training in a second process, at the lowest CPU priority (the default on the CPU).

On a CPU, a training thread inside the serving process shares XLA's thread pool with serving:
while one of its large matrix products holds the pool's threads, a round's many small operations
wait behind it, and serving lost more than the share training was given (0.77x the throughput
at a share of 0.25, measured on two cores). In a process of its own at nice 19, training runs on
the cycles serving leaves and the operating system gives serving the CPU first; its share is
counted in CPU time (OnlineTrainer.clock).

The serving side (OnlineProcess) has OnlineTrainer's face: observe, stats, save, close. A thread
reads each finished request's features onto the host and sends the request to the training
process, which holds the buffer and trains, scores and revises the vocabulary as
OnlineTrainer does (the same code). When a copy scores higher, the training process writes it in
the public EAGLE-3 layout into a folder the serving side made, and the serving side swaps it in
(Engine.swap_draft) and removes the head it replaced. Output is unchanged, as in one process:
verification decides every token.

If the training process dies (out of memory, killed), serving goes on with the head in use, and
says so in the log.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import types
from multiprocessing.connection import Connection

from jaxspec import compile_target
from jaxspec.errors import JaxspecError
from jaxspec.speculative.online import (
    NO_STATS,
    OnlineConfig,
    OnlineTrainer,
    check,
    copy_head,
    cpu_seconds,
    served,
)

logger = logging.getLogger(__name__)
NICE = 19  # the training process's niceness: serving has the CPU first


def wanted_process(cfg: OnlineConfig, loaded) -> bool:
    """Whether online training runs in a second process: as set, else on the CPU when the target
    was loaded from a path the training process can load it from again."""
    if cfg.process is not None:
        return cfg.process

    return compile_target.platform() == "cpu" and loadable(loaded)


def loadable(loaded) -> bool:
    """Whether the target was loaded from a path that holds it (not given in memory)."""
    return loaded.source_kind != "memory" and os.path.exists(loaded.path)


class OnlineProcess:
    """Online training in a child process (module docstring), for one engine."""

    def __init__(self, engine, cfg: OnlineConfig):
        check(engine, cfg)
        if not loadable(engine.loaded):
            raise JaxspecError(
                "speculative_online_train_process: the training process loads the target from its path, and this "
                "target was given in memory (leave the setting unset, or off)"
            )
        self.engine = engine
        self.head_path = engine.spec.draft_model_path  # the head in use
        self._dir = tempfile.mkdtemp(prefix="jaxspec-online-")
        self._lock = threading.Lock()
        self._stats: dict = {}
        self.version = 0  # heads swapped in here
        self._todo: queue.Queue = queue.Queue(maxsize=cfg.buffer)  # finished requests not yet sent
        self._stop = threading.Event()
        # A fresh interpreter, not a fork (of a process holding XLA's threads) nor multiprocessing's
        # spawn (which imports the caller's main script again: a script that makes an Engine at top
        # level would make one more). The pipe is a socket pair the child inherits.
        self._conn, child = multiprocessing.Pipe()
        fd = child.fileno()
        cmd = [sys.executable, "-m", "jaxspec.speculative.online_process", str(fd)]
        env = dict(os.environ)  # the jaxspec this process imported, wherever it came from
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=env)
        child.close()
        level = logging.getLogger("jaxspec").getEffectiveLevel()
        spec = engine.spec
        self._conn.send(
            (engine.loaded.path, engine.args.dtype, spec.draft_model_path, spec.num_steps, cfg, self._dir, level)
        )
        self._sender = threading.Thread(target=self._send_loop, name="jaxspec-online-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="jaxspec-online-receive", daemon=True)
        self._sender.start()
        self._receiver.start()
        atexit.register(self.close)

    def observe(self, prompt_ids: list[int], output_ids: list[int], feats, first: int = 0) -> None:
        """As OnlineTrainer.observe; never blocks (when the training process falls a buffer behind,
        the request is dropped)."""
        rec = served(prompt_ids, output_ids, feats, first)
        if rec is None or self._stop.is_set():
            return
        try:
            self._todo.put_nowait(rec)
        except queue.Full:
            pass

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                rec = self._todo.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                rec.features()  # onto the host (waits for the read the serving side enqueued)
            except Exception:  # that request is not learnt from; serving is not concerned
                logger.exception("online draft training: a finished request's features could not be read")
                continue
            try:
                with self._lock:
                    self._conn.send(("add", rec))
            except (OSError, ValueError):  # the training process is gone (the receiver says so)
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                kind, value = self._conn.recv()
            except (OSError, EOFError):
                if not self._stop.is_set():
                    logger.warning(
                        "online draft training's process ended (exit code %s); serving goes on with the head in use",
                        self._proc.poll(),
                    )
                return
            if kind == "stats":
                with self._lock:
                    self._stats = value
            elif kind == "swap":
                self._swap_in(value)

    def _swap_in(self, path: str) -> None:
        try:
            self.engine.swap_draft(path)
        except Exception:
            logger.exception("online draft training: the head at %s could not be swapped in", path)
            return
        with self._lock:  # (save() copies the head in use under the lock)
            old, self.head_path = self.head_path, path
            if os.path.dirname(old) == self._dir:  # the head it replaced, written here too
                shutil.rmtree(old, ignore_errors=True)
            self.version += 1

    def stats(self) -> dict:
        """As OnlineTrainer.stats, as the training process last reported them (draft_version: the
        heads swapped in here)."""
        with self._lock:
            return {**NO_STATS, **self._stats, "draft_version": self.version}

    def save(self, path: str) -> str:
        """As OnlineTrainer.save: writes the head in use to `path` (copy_head)."""
        with self._lock:  # (a swap removes the head it replaces under the lock)
            return copy_head(self.head_path, path)

    def close(self) -> None:
        """Stops the training process (it ends its step first) and removes the heads written here."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            with self._lock:
                self._conn.send(("stop", None))
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._conn.close()
        atexit.register(shutil.rmtree, self._dir, True)  # at exit: save() may still read the head in use


def _child(
    conn, model_path: str, dtype: str, head_path: str, num_steps: int, cfg: OnlineConfig, out: str, level: int
) -> None:
    """The training process: loads the target, then trains on what the serving side sends."""
    os.nice(NICE)
    # on an accelerator, take memory as needed rather than the share a serving process takes at start
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s (training process): %(message)s")
    from jaxspec.loader import load

    send_lock = threading.Lock()

    def send(kind, value) -> None:
        with send_lock:
            conn.send((kind, value))

    spec = types.SimpleNamespace(algorithm="EAGLE3", num_steps=num_steps, draft_model_path=head_path)
    stand_in = types.SimpleNamespace(
        spec=spec,
        quantization=None,
        tp_size=1,
        loaded=load(model_path, dtype, progress=False, with_tokenizer=False),
        swap_draft=lambda path: send("swap", path),
    )
    trainer = OnlineTrainer(
        stand_in, cfg, out_dir=out, on_change=lambda s: send("stats", s), prune=False, clock=cpu_seconds
    )
    while True:
        try:
            kind, value = conn.recv()
        except (OSError, EOFError):  # the serving process is gone
            break
        if kind == "stop":
            break
        trainer.add(value)
        if trainer.seen % 8 == 0:
            trainer.report()  # the buffer's size, before training starts
    trainer.close()


if __name__ == "__main__":  # the training process (OnlineProcess starts it)
    _conn = Connection(int(sys.argv[1]))
    _child(_conn, *_conn.recv())

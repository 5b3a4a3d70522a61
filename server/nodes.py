"""Serving across hosts: node 0 schedules, the other nodes repeat its device calls.

With tensor parallelism over several hosts (`--nnodes N --node-rank R --dist-init-addr HOST:PORT`)
JAX runs one process per host, and every process must start the same compiled programs in the
same order on its share of the mesh. Node 0 runs the HTTP server and the scheduler; the others run
neither. The scheduler changes the device state (the weights and the request slots) only through
the compiled programs of server/programs.py, so node 0 sends each call it makes, as the program's
key and its small host arguments, to the other nodes, which apply it to their own copies of the
state. Every choice (admission, prefix reuse, adaptive speculation, timing) is thus node 0's alone
and the nodes cannot drift apart.

The channel is a TCP connection from every other node to node 0 on the port after
--dist-init-addr's, authenticated with a key (JAXSPEC_NODE_KEY; the same on every node). Like
jax.distributed's coordinator, it belongs on a private network. A node that goes away stops the
group: node 0 cannot run a program without it, so it exits rather than leave clients hanging.

Call order: both sides build the engine, then `connect()` (node 0 listens, the others dial it),
then the scheduler, whose slot count is node 0's (`agree`); start-up compilation runs everywhere
(the same programs in the same order), then node 0 serves while the others `follow()`.
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import jax

from jaxspec.errors import JaxspecError
from jaxspec.sharding import to_host, to_mesh
from jaxspec.weights import Models

logger = logging.getLogger("jaxspec.server")

# the arguments a call holds by reference: each node has its own copy
MODELS, TARGET_MODELS, BATCH = "@models", "@target_models", "@batch"


def channel_address(dist_init_addr: str) -> tuple[str, int]:
    """(host, port) of node 0's channel: --dist-init-addr's host, the port after its port."""
    host, _, port = dist_init_addr.rpartition(":")
    return host, int(port) + 1


def _key() -> bytes:
    return os.environ.get("JAXSPEC_NODE_KEY", "jaxspec").encode()


def new_batch(key: tuple, out: Any) -> Any:
    """The request slots a program returns: copy and chunk programs return them alone, finish and
    dispatch programs as the first of two."""
    return out if key[0] in ("copy", "chunk") else out[0]


class Nodes:
    """This process's place in a group of hosts: node 0 (`leader`) sends, the others receive."""

    def __init__(self, dist_init_addr: str, nnodes: int, node_rank: int, timeout: float = 600.0):
        self.addr = channel_address(dist_init_addr)
        self.nnodes, self.rank, self.timeout = nnodes, node_rank, timeout
        self.leader = node_rank == 0
        self.conns: list[Connection] = []
        self.sched: Any = None  # set by the scheduler that uses this group

    # ---- start-up ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Node 0 waits for every other node to dial in (up to `timeout` seconds); the others dial
        until node 0 listens."""
        if self.leader:
            with Listener(self.addr, authkey=_key()) as lst:
                lst._listener._socket.settimeout(self.timeout)  # type: ignore[attr-defined]
                while len(self.conns) < self.nnodes - 1:
                    try:
                        conn = lst.accept()
                    except OSError as e:  # timeout or a peer with the wrong key
                        raise JaxspecError(
                            f"node 0: {len(self.conns) + 1} of {self.nnodes} nodes joined within "
                            f"{self.timeout:.0f} s on {self.addr[0]}:{self.addr[1]} ({e}); start every node with "
                            "the same --nnodes and --dist-init-addr, and the same JAXSPEC_NODE_KEY"
                        ) from e
                    rank = conn.recv()
                    logger.warning("node %d joined", rank)
                    self.conns.append(conn)
            return
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn = Client(self.addr, authkey=_key())
                break
            except (ConnectionRefusedError, OSError) as e:
                if time.monotonic() > deadline:
                    raise JaxspecError(f"node {self.rank}: node 0 did not answer on {self.addr} ({e})") from e
                time.sleep(0.2)
        conn.send(self.rank)
        self.conns = [conn]

    def agree(self, what: str, value: Any) -> Any:
        """Node 0's `value` on every node (a memory plan, say, that could differ between hosts)."""
        if self.leader:
            self._send(("agree", what, value))
            return value
        msg = self._recv()
        if msg[:2] != ("agree", what):
            raise JaxspecError(f"node {self.rank}: expected node 0's {what}, got {msg[0]!r}")
        if msg[2] != value:
            logger.warning("node %d: %s %r -> node 0's %r", self.rank, what, value, msg[2])
        return msg[2]

    # ---- node 0 --------------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        for conn in self.conns:
            try:
                conn.send(msg)
            except OSError:
                # a program cannot run without every node: stop rather than hang the clients
                logger.critical("a node of the group is gone: node 0 stops (restart every node)")
                os._exit(1)

    def run(self, key: tuple, prog: Any, *args: Any) -> Any:
        """Runs `prog` here after telling the other nodes to run the program of `key` on the same
        arguments (the models and the request slots by reference, host values by value)."""
        s = self.sched

        def by_ref(a: Any) -> str | None:
            if isinstance(a, Models):
                return TARGET_MODELS if a.prop is None else MODELS
            return BATCH if a is s.batch else None

        sent = tuple(by_ref(a) or to_host(a) for a in args)
        self._send(("run", key, sent))
        # here too from the host values: arrays on this process's devices alone do not match the
        # programs' inputs, which span every node's devices
        return prog(*(a if isinstance(h, str) else to_mesh(h, s.eng.mesh) for a, h in zip(args, sent)))

    def tell_exercise(self, key: tuple) -> None:
        """The other nodes run the program of `key` once on free slots, as node 0 is about to."""
        self._send(("exercise", key))

    def tell_recreate(self) -> None:
        """The other nodes re-create their request slots, as node 0 is about to (failure recovery)."""
        self._send(("recreate",))

    def stop(self) -> None:
        """Node 0: tells the others to stop. Every node: leaves the group together with the others
        (jax.distributed counts a node that exits alone as failed, and stops the rest)."""
        if not self.conns:
            return
        if self.leader:
            self._send(("stop",))
        for conn in self.conns:
            conn.close()
        self.conns = []
        jax.distributed.shutdown()

    # ---- the other nodes -----------------------------------------------------------------------

    def _recv(self) -> tuple:
        try:
            return self.conns[0].recv()
        except (EOFError, OSError) as e:
            raise JaxspecError(f"node {self.rank}: node 0 is gone ({type(e).__name__})") from e

    def follow(self) -> int:
        """Applies node 0's calls to this node's state until node 0 stops (returns 0) or goes away
        (raises JaxspecError)."""
        s = self.sched
        ref = {MODELS: lambda: s.eng.models, TARGET_MODELS: lambda: s.eng.target_models, BATCH: lambda: s.batch}
        calls = 0
        while True:
            msg = self._recv()
            if msg[0] == "stop":
                logger.warning("node %d: node 0 stopped after %d calls", self.rank, calls)
                return 0
            if msg[0] == "run":
                _, key, sent = msg
                args = [ref[a]() if isinstance(a, str) else to_mesh(a, s.eng.mesh) for a in sent]
                s.batch = new_batch(key, s.programs.get_local(key)(*args))
                calls += 1
            elif msg[0] == "exercise":
                s.programs.exercise(msg[1], s.programs.get_local(msg[1]))
            elif msg[0] == "recreate":
                s.recreate_slots()
            else:
                raise JaxspecError(f"node {self.rank}: unknown message {msg[0]!r} from node 0")

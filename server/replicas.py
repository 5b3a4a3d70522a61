"""`jaxspec serve --dp-size N`: N replicas of the server on one host behind SGLang's router.

The launcher loads no model itself. It checks what it can before any weights load (the router is
installed, the ports are free, there are devices or cores for every replica), then starts:
  replicas  N `jaxspec serve` processes with the same flags, replica i on port --port + 1 + i and
            127.0.0.1, each on its own devices: on a GPU host --tp-size GPUs each
            (CUDA_VISIBLE_DEVICES), on a CPU its share of the cores (CPU affinity)
  router    `python -m sglang_router.launch_router` on --host/--port once every replica answers
            /health, with the replicas as its workers and --router-policy as its policy
and supervises them: a replica that exits is started again (the router's health checks take it
out meanwhile, and its retries send the requests it refused to the others); SIGTERM or Ctrl-C
stops the router first, then lets every replica drain (--shutdown-timeout) and stop. Each
replica keeps its own /metrics and /get_server_info on its own port.
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from jaxspec.args import EngineArgs, ServerArgs
from jaxspec.cli_flags import to_argv
from jaxspec.errors import JaxspecError

logger = logging.getLogger("jaxspec.server")

READY_TIMEOUT_S = 900.0  # a replica's first start compiles its programs (minutes on a small CPU)
RESTART_BACKOFF_S = (1.0, 5.0, 30.0)  # waits before restarting a replica that keeps exiting


@dataclasses.dataclass
class Replica:
    index: int
    port: int
    env: dict[str, str]
    cores: list[int] | None  # CPU: the cores it runs on
    proc: subprocess.Popen | None = None
    restarts: int = 0  # restarts in a row (reset once it has run for ten minutes)
    started: float = 0.0  # time.monotonic() of its latest start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def gpu_count() -> int:
    """GPUs visible to this process (CUDA_VISIBLE_DEVICES, else nvidia-smi), without starting JAX."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([x for x in visible.split(",") if x.strip() and x.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def plan(engine: EngineArgs, server: ServerArgs) -> list[Replica]:
    """The replicas to start, or a JaxspecError saying what to change (before any weights load)."""
    n = server.dp_size
    if importlib.util.find_spec("sglang_router") is None:
        raise JaxspecError(
            "--dp-size needs SGLang's router: pip install sglang-router (or pip install 'jaxspec[router]')"
        )
    ports = [server.port + 1 + i for i in range(n)]
    if not port_free(server.host, server.port):
        raise JaxspecError(f"--port {server.port} is in use on {server.host}; pick another --port")
    taken = [p for p in ports if not port_free("127.0.0.1", p)]
    if taken:
        raise JaxspecError(
            f"the replicas listen on ports {ports[0]}-{ports[-1]} (--port + 1 onwards); {taken} in use: pick another --port"
        )
    gpus = gpu_count()
    replicas = []
    if gpus:
        if n * engine.tp_size > gpus:
            raise JaxspecError(
                f"--dp-size {n} x --tp-size {engine.tp_size} needs {n * engine.tp_size} GPUs; {gpus} are visible"
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x.strip() for x in (visible or "").split(",") if x.strip() and x.strip() != "-1"]
        ids = ids or [str(i) for i in range(gpus)]
        for i, port in enumerate(ports):
            group = ids[i * engine.tp_size : (i + 1) * engine.tp_size]
            replicas.append(Replica(i, port, {"CUDA_VISIBLE_DEVICES": ",".join(group)}, None))
        return replicas
    if engine.tp_size > 1:
        raise JaxspecError("--dp-size with --tp-size > 1 needs GPUs (on a CPU each replica runs on its own cores)")
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise JaxspecError(f"--dp-size {n} replicas on a CPU need a core each; this process may use {len(cores)}")
    share = len(cores) // n
    for i, port in enumerate(ports):
        mine = cores[i * share : (i + 1) * share]
        replicas.append(Replica(i, port, {"JAX_PLATFORMS": "cpu"}, mine))
    return replicas


def replica_argv(engine: EngineArgs, server: ServerArgs, port: int) -> list[str]:
    """`jaxspec serve` flags of one replica: the group's own, on its port, alone."""
    own = dataclasses.replace(server, host="127.0.0.1", port=port, dp_size=1, router_policy="cache_aware")
    return [sys.executable, "-m", "jaxspec.cli", "serve", *to_argv(engine), *to_argv(own)]


def router_argv(server: ServerArgs, replicas: list[Replica]) -> list[str]:
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", server.host, "--port", str(server.port)]
    argv += ["--worker-urls", *(r.url for r in replicas), "--policy", server.router_policy]
    argv += ["--log-level", "warn", "--request-timeout-secs", "3600"]
    # replicas on one host: a dead one is noticed, and a restarted one taken back, within seconds
    # (the router's defaults, for remote workers, check every 60 s and trip its breaker for 60 s)
    argv += ["--health-check-interval-secs", "5", "--health-failure-threshold", "2", "--health-success-threshold", "1"]
    argv += ["--cb-timeout-duration-secs", "10", "--shutdown-grace-period-secs", str(int(server.shutdown_timeout))]
    # cache-aware routing turns to the least loaded replica once one holds 2 more requests than
    # another (the router's default, 64, is for big GPU servers: prompts sharing a system prompt
    # would all go to one replica of a few slots while the others idle)
    argv += ["--balance-abs-threshold", "1", "--balance-rel-threshold", "1.2"]
    if server.api_key:
        argv += ["--api-key", server.api_key]
    return argv


class ReplicaGroup:
    def __init__(self, engine: EngineArgs, server: ServerArgs):
        self.engine, self.server = engine, server
        self.replicas = plan(engine, server)
        self.router: subprocess.Popen | None = None
        self.stopping = False

    def start_replica(self, r: Replica) -> None:
        env = {**os.environ, **r.env}
        cores = r.cores

        def pin() -> None:  # in the child, before exec
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        r.proc = subprocess.Popen(replica_argv(self.engine, self.server, r.port), env=env, preexec_fn=pin)
        if r.restarts and time.monotonic() - r.started > 600:  # it ran a while: back to the shortest wait
            r.restarts = 0
        r.started = time.monotonic()
        where = f"cores {r.cores[0]}-{r.cores[-1]}" if r.cores else f"GPUs {r.env.get('CUDA_VISIBLE_DEVICES')}"
        logger.warning("replica %d: pid %d on %s, port %d", r.index, r.proc.pid, where, r.port)

    def healthy(self, r: Replica) -> bool:
        try:
            c = http.client.HTTPConnection("127.0.0.1", r.port, timeout=5)
            c.request("GET", "/health")
            return c.getresponse().status == 200
        except OSError:
            return False

    def wait_ready(self) -> None:
        t = time.monotonic()
        waiting = list(self.replicas)
        while waiting:
            for r in list(waiting):
                assert r.proc is not None
                if r.proc.poll() is not None:
                    raise JaxspecError(f"replica {r.index} exited with code {r.proc.returncode} while starting")
                if self.healthy(r):
                    waiting.remove(r)
            if self.stopping:
                raise KeyboardInterrupt
            if time.monotonic() - t > READY_TIMEOUT_S:
                raise JaxspecError(f"replicas {[r.index for r in waiting]} not ready after {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.5)

    def start_router(self) -> None:
        self.router = subprocess.Popen(router_argv(self.server, self.replicas), preexec_fn=_die_with_parent)
        logger.warning(
            "router: pid %d on http://%s:%d, policy %s, over %s",
            self.router.pid,
            self.server.host,
            self.server.port,
            self.server.router_policy,
            ", ".join(r.url for r in self.replicas),
        )

    def supervise(self, poll_s: float = 1.0) -> None:
        """Until stopped: restarts a replica (or the router) that exited."""
        due: dict[int | str, float] = {}  # replica index (or "router") -> when to start it again
        while not self.stopping:
            now = time.monotonic()
            for r in self.replicas:
                assert r.proc is not None
                if r.proc.poll() is None:
                    continue
                if r.index not in due:
                    wait = RESTART_BACKOFF_S[min(r.restarts, len(RESTART_BACKOFF_S) - 1)]
                    logger.error(
                        "replica %d exited (code %s): restarting it in %.0f s", r.index, r.proc.returncode, wait
                    )
                    due[r.index] = now + wait
                elif now >= due[r.index]:
                    del due[r.index]
                    r.restarts += 1
                    self.start_replica(r)
            if self.router is not None and self.router.poll() is not None:
                if "router" not in due:
                    logger.error("the router exited (code %s): restarting it in 5 s", self.router.returncode)
                    due["router"] = now + 5.0
                elif now >= due["router"]:
                    del due["router"]
                    self.start_router()
            time.sleep(poll_s)

    def stop(self) -> None:
        """The router first (no new requests), then every replica drains and stops."""
        self.stopping = True
        grace = self.server.shutdown_timeout + 10.0
        if self.router is not None:  # it lets the requests passing through finish (its grace period)
            if self.router.poll() is None:
                self.router.send_signal(signal.SIGTERM)
            _wait(self.router, grace)
        procs = [r.proc for r in self.replicas if r.proc]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            _wait(p, max(deadline - time.monotonic(), 0.1))


def _die_with_parent() -> None:
    """(In a child, before exec) SIGTERM when the launcher dies, even by SIGKILL (Linux), so that no
    replica or router outlives it holding its port."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait(p: subprocess.Popen, timeout: float) -> None:
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def run(engine: EngineArgs, server: ServerArgs) -> int:
    """Starts the group and serves until SIGTERM / Ctrl-C. Returns the exit code."""
    group = ReplicaGroup(engine, server)

    def on_signal(signum, frame):
        group.stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for r in group.replicas:
            group.start_replica(r)
        group.wait_ready()
        group.start_router()
        print(
            f"jaxspec serve: {len(group.replicas)} replicas behind SGLang's router "
            f"({server.router_policy}) on http://{server.host}:{server.port} (Ctrl-C to stop)",
            file=sys.stderr,
            flush=True,
        )
        group.supervise()
    except KeyboardInterrupt:
        pass
    finally:
        group.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return 0

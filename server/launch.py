"""`jaxspec serve`: load the model (and draft), plan memory, precompile, run uvicorn."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import jax

from jaxspec.args import EngineArgs, MultiHostArgs, ServerArgs, compatibility_notes
from jaxspec.cli_flags import from_namespace
from jaxspec.default_mode import target_mode
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.server import replicas
from jaxspec.server.app import create_app
from jaxspec.server.nodes import Nodes
from jaxspec.server.scheduler import Scheduler, warmup

logger = logging.getLogger("jaxspec.server")


def default_served_name(model_path: str | None) -> str:
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model_path)) or model_path


def _nodes(args, eng: Engine) -> Nodes | None:
    """This process's group of hosts (server/nodes.py), joined; None on one host."""
    hosts = from_namespace(MultiHostArgs, args)
    if hosts.nnodes == 1:
        return None
    if eng.tp_size != jax.device_count():
        raise JaxspecError(
            f"serving across {hosts.nnodes} hosts needs --tp-size {jax.device_count()} (every device of every host), "
            f"got {eng.tp_size}"
        )
    assert hosts.dist_init_addr is not None  # init_distributed has checked it
    nodes = Nodes(hosts.dist_init_addr, hosts.nnodes, hosts.node_rank)
    nodes.connect()
    return nodes


def build(args, progress: bool = True):
    """(app, scheduler) from parsed `jaxspec serve` arguments; raises JaxspecError on bad flags or OOM.
    On a node other than node 0 of several hosts, app is None: the scheduler's `nodes.follow()`
    is what that node runs."""
    flags = from_namespace(EngineArgs, args)
    server = from_namespace(ServerArgs, args)
    server.validate()
    for note in compatibility_notes(server):
        logging.getLogger("jaxspec").warning(note)
    eng = Engine(flags, show_progress=progress)
    nodes = _nodes(args, eng)
    sched = Scheduler(
        eng,
        flags.max_running_requests,
        server.mem_fraction_static,
        server.max_queued_requests,
        server.num_continuous_decode_steps,
        overlap=not server.disable_overlap_schedule,
        prefix_cache=not server.disable_radix_cache,
        nodes=nodes,
    )
    if not server.disable_cuda_graph:
        t = time.perf_counter()
        default_bs = 1 if jax.devices()[0].platform == "cpu" else 8
        n = warmup(
            sched,
            server.cuda_graph_max_bs or default_bs,
            progress=progress,
            background=not server.disable_background_compile,
        )
        logger.warning(
            "compiled %d start-up programs in %.1f s%s",
            n,
            time.perf_counter() - t,
            ""
            if server.disable_background_compile
            else f"; compiling {sched.programs.background_total} more in the background",
        )
    if nodes is not None and not nodes.leader:
        return None, sched
    name = server.served_model_name or default_served_name(flags.model_path)
    # /get_server_info reports every flag but the key
    server_args = {**dataclasses.asdict(flags), **dataclasses.asdict(server)}
    server_args.pop("api_key")
    app = create_app(
        sched, name, api_key=server.api_key, max_body_bytes=server.max_request_bytes, server_args=server_args
    )
    return app, sched


def cmd_serve(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = from_namespace(ServerArgs, args)
    server.validate()
    if server.dp_size > 1:  # replicas behind SGLang's router (this process loads no model)
        flags = from_namespace(EngineArgs, args)
        flags.validate()
        return replicas.run(flags, server)
    app, sched = build(args)
    if app is None:  # a node other than node 0: it repeats node 0's device calls until node 0 stops
        print(f"jaxspec serve: node {args.node_rank} of {args.nnodes}, following node 0", file=sys.stderr, flush=True)
        try:
            return sched.nodes.follow()
        finally:
            sched.programs.stop()
            sched.nodes.stop()
    spec = sched.spec
    desc = (
        "plain decoding"
        if spec is None
        else f"{spec.algorithm} {spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}"
        + (" (adaptive: that tree, a shallower one or plain steps, per dispatch)" if spec.adaptive else " (static)")
    )
    print(
        f"jaxspec serve: target in {target_mode(sched.eng)}; {sched.slots} request slots x "
        f"{sched.context_length} tokens, {desc}; "
        f"listening on http://{args.host}:{args.port} (Ctrl-C to stop)",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    return 0

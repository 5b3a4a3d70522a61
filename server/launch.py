"""`jaxspec serve`: load the model (and draft), plan memory, precompile, run uvicorn."""

from __future__ import annotations

import logging
import os
import sys
import time

from jaxspec.errors import JaxspecError

logger = logging.getLogger("jaxspec.server")


def add_serve_args(p) -> None:
    g = p.add_argument_group("server (SGLang's flags)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    g.add_argument("--served-model-name", default=None, help="the model name /v1/models reports and requests may use (besides 'default')")
    g.add_argument("--mem-fraction-static", type=float, default=0.8,
                   help="fraction of device memory (host RAM on CPU) for weights + KV-cache slots")
    g.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests beyond this get 503 + Retry-After")
    g.add_argument("--num-continuous-decode-steps", type=int, default=None,
                   help="rounds per compiled dispatch between admissions/streaming (auto: 8 on GPU, 2 on CPU)")
    g.add_argument("--disable-overlap-schedule", action="store_true", help="fetch each dispatch's results before enqueuing the next")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="at start-up, compile decoding for batch sizes 1, 2, 4, .. up to this at KV spans up to 512 (default: 8 on GPU, "
                   "2 on CPU; at most the slots); larger shapes are covered by the largest programs until the background compile reaches them")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="compile nothing ahead: each program shape compiles on first use (a request may wait for it)")
    g.add_argument("--disable-background-compile", action="store_true",
                   help="compile only the start-up programs; shapes they do not cover exactly compile on first use")
    g.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger request bodies get 413")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled")
    p.set_defaults(max_running_requests=None)


def default_served_name(model_path: str | None) -> str:
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model_path)) or model_path


def build(args, progress: bool = True):
    """(app, scheduler) from parsed `jaxspec serve` arguments; raises JaxspecError on bad flags or OOM."""
    from jaxspec.engine import Engine
    from server.app import create_app
    from server.scheduler import Scheduler, warmup

    if not 1 <= args.port <= 65535:
        raise JaxspecError(f"--port must be in 1..65535, got {args.port}")
    spec = {k: v for k, v in vars(args).items() if k.startswith("speculative_")}
    eng = Engine(model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype, context_length=args.context_length,
                 max_running_requests=args.max_running_requests or 8, chunked_prefill_size=args.chunked_prefill_size,
                 attention_backend=args.attention_backend, random_seed=args.random_seed, log_level=args.log_level,
                 show_progress=progress, tp_size=args.tp_size, **spec)
    sched = Scheduler(eng, args.max_running_requests, args.mem_fraction_static, args.max_queued_requests,
                      args.num_continuous_decode_steps, overlap=not args.disable_overlap_schedule)
    if not args.disable_cuda_graph:
        t = time.perf_counter()
        import jax

        default_bs = 2 if jax.devices()[0].platform == "cpu" else 8
        n = warmup(sched, args.cuda_graph_max_bs or default_bs, progress=progress, background=not args.disable_background_compile)
        logger.warning("compiled %d start-up programs in %.1f s%s", n, time.perf_counter() - t,
                       "" if args.disable_background_compile else f"; compiling {sched.programs.background_total} more in the background")
    name = args.served_model_name or default_served_name(args.model_path)
    server_args = {k: v for k, v in vars(args).items() if k not in ("func", "command", "api_key")}
    app = create_app(sched, name, api_key=args.api_key, max_body_bytes=args.max_request_bytes, server_args=server_args)
    return app, sched


def cmd_serve(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, sched = build(args)
    spec = sched.eng.spec
    desc = "plain decoding" if not spec.enabled else f"{spec.algorithm} {spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}"
    print(f"jaxspec serve: {sched.slots} request slots x {sched.context_length} tokens, {desc}; "
          f"listening on http://{args.host}:{args.port} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0

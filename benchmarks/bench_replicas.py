"""Data-parallel scaling: 2 replicas x 1 core behind SGLang's router against 1 replica x 1 core.

    python benchmarks/bench_replicas.py [--modes plain eagle3] [--concurrency 8] [--requests 32]
        [--max-tokens 64] [--context-length N] [--model-path P] [--out DIR]

For each mode it starts one `jaxspec serve` pinned to core 0 (CPU affinity), measures, stops it,
then starts `jaxspec serve --dp-size 2` (replicas on cores 0 and 1, the router on top) and measures
the same load: MT-bench first turns as chat completions (greedy, non-streaming) from
--concurrency client threads, after an untimed warm-up pass of the same requests. It reports
output throughput (completion tokens / wall time) of each and their ratio. Needs 2 cores and the
sglang-router package.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import signal
import subprocess
import sys
import time

from common import BENCH_CONTEXT, add_model_arguments, machine, mtbench_first_turns

MODES = {"plain": ["--speculative-algorithm", "NONE"], "eagle3": []}  # eagle3: the shipped head, adaptive


def start(argv: list[str], port: int, log_path: str, cores: set[int] | None) -> subprocess.Popen:
    """A `jaxspec serve` process (pinned to `cores` if given) once `port` answers /v1/models."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    log = open(log_path, "w")
    p = subprocess.Popen(
        [sys.executable, "-m", "jaxspec.cli", "serve", *argv],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
    t = time.time()
    while True:
        if p.poll() is not None:
            raise SystemExit(f"server exited ({p.returncode}); see {log_path}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/v1/models")
            if c.getresponse().status == 200:
                return p
        except OSError:
            pass
        if time.time() - t > 1200:
            p.kill()
            raise SystemExit(f"server did not start in 1200 s; see {log_path}")
        time.sleep(1)


def model_name(port: int) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]


def load(port: int, questions: list[str], conc: int, max_tokens: int) -> tuple[float, int]:
    """(wall seconds, completion tokens) of the questions sent from `conc` threads."""
    name = model_name(port)

    def one(q: str) -> int:
        body = {"model": name, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0}
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
        c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        d = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {d}")
        return d["usage"]["completion_tokens"]

    t = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as ex:
        tokens = sum(ex.map(one, questions))
    return time.perf_counter() - t, tokens


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    add_model_arguments(ap, BENCH_CONTEXT)
    ap.add_argument("--port", type=int, default=31200)
    ap.add_argument("--out", default="/tmp/bench_replicas")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores")
    questions = mtbench_first_turns(args.requests)
    common = ["--context-length", str(args.context_length), "--max-running-requests", str(args.concurrency)]
    common += ["--model-path", args.model_path] if args.model_path else []
    common += ["--cuda-graph-max-bs", str(args.concurrency), "--log-level", "warning"]
    common += ["--dtype", "float32"]  # the float32 model, whose default is the shipped draft (gguf's is plain)
    rows = []
    for mode in args.modes:
        for label, extra, cores in (("1 replica x 1 core", [], {0}), ("2 replicas x 1 core", ["--dp-size", "2"], None)):
            argv = [*MODES[mode], *common, *extra, "--port", str(args.port)]
            p = start(argv, args.port, os.path.join(args.out, f"{mode}-{len(extra)}.log"), cores)
            try:
                load(args.port, questions, args.concurrency, args.max_tokens)  # warm-up, untimed
                wall, tokens = load(args.port, questions, args.concurrency, args.max_tokens)
            finally:
                stop(p)
            rows.append({"mode": mode, "setup": label, "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall})
            print(f"{mode:7s} {label:20s} {tokens:6d} tokens in {wall:7.1f} s: {tokens / wall:7.1f} tok/s", flush=True)
    print(
        f"\n{machine()}; {args.requests} MT-bench first turns, {args.max_tokens} new tokens, concurrency {args.concurrency}"
    )
    print("| mode | 1 replica x 1 core (tok/s) | 2 replicas x 1 core (tok/s) | ratio |")
    print("|---|---|---|---|")
    for mode in args.modes:
        one, two = (r["tok_per_s"] for r in rows if r["mode"] == mode)
        print(f"| {mode} | {one:.1f} | {two:.1f} | {two / one:.2f}x |")
    with open(os.path.join(args.out, "replicas.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

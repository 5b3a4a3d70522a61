"""Load test of `jaxspec serve`: plain vs speculative serving, side by side in one run.

    python benchmarks/bench_serve.py [--modes plain eagle3 eagle3-static] [--concurrency 1 4 16]
        [--requests 16] [--time-limit 300] [--max-tokens 128] [--ignore-eos] [--temperature 0 1]
        [--workload mtbench|code|quote|agent] [--seed 0]

It starts one server per mode on 127.0.0.1 (free ports; loopback only), waits until every one has
finished its background compiles (so that none takes cores from another's timed level), then for
each concurrency `c` runs the modes one after another, interleaved, so that they see the same
machine: MT-bench first turns (or, with --workload, bench_repetitive.py's conversations where text
repeats: code edits, answers quoting passages, an agent loop; fixed by --seed, the same as that
script's first --requests) as streaming chat completions from `c` client threads. It reports
output throughput (completion tokens / wall time), request latency and time-to-first-token
percentiles, the gaps between streamed chunks (how smooth streaming is), the mean accept length,
and the share of rounds run with each tree shape (adaptive speculation). Each level is bounded
by --requests and --time-limit; each level first runs once untimed (--warmup) for every mode,
and every server finishes the compiles it was asked for before any level is timed. After each
untimed pass every server's /flush_cache forgets the prefixes it cached and the text it keeps for
text matching, so that a timed request neither reuses its own warm-up's KV nor copies its own
warm-up answer (NGRAM, hybrid).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import numpy as np
from common import BENCH_CONTEXT, add_model_arguments, machine, mtbench_first_turns

MODES = {
    "plain": ["--speculative-algorithm", "NONE"],
    "eagle3": [],  # the float32 model's default: the shipped EAGLE-3 head, adaptive speculation, overlap on
    "eagle3-static": ["--no-speculative-adaptive"],  # its tree shape every round
    "eagle3-no-overlap": ["--disable-overlap-schedule"],
    "plain-no-overlap": ["--speculative-algorithm", "NONE", "--disable-overlap-schedule"],
    "eagle2": ["--speculative-algorithm", "EAGLE"],
    "ngram": ["--speculative-algorithm", "NGRAM"],
    # the default EAGLE-3 head at the server's tree shape, with 4 text-match candidates merged into it
    "hybrid": ["--speculative-suffix-draft-tokens", "4"],
}
WORKLOADS = ("mtbench", "code", "quote", "agent")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra, port, args):
    cmd = [
        sys.executable,
        "-m",
        "jaxspec.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--context-length",
        str(args.context_length),
        "--max-running-requests",
        str(max(args.concurrency)),
        "--cuda-graph-max-bs",
        str(max(args.concurrency)),
        *(["--model-path", args.model_path] if args.model_path else []),
        *["--dtype", "float32"],  # the modes compare drafts over the float32 model (a GGUF's CPU default is gguf)
        *extra,
        *args.server_args,
    ]
    log = open(os.path.join(args.out, f"server-{port}.log"), "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t = time.time()
    while True:
        if p.poll() is not None:
            raise SystemExit(f"server exited ({p.returncode}); see {log.name}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p, time.time() - t
        except OSError:
            pass
        if time.time() - t > args.startup_timeout:
            p.kill()
            raise SystemExit(f"server did not start in {args.startup_timeout} s; see {log.name}")
        time.sleep(0.5)


def metric_values(port, name: str) -> dict[str, float]:
    """{labels: value} of the /metrics lines of jaxspec:<name> (retried: a server busy compiling
    may drop a connection)."""
    for attempt in range(10):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("GET", "/metrics")
            text = c.getresponse().read().decode()
            break
        except OSError:
            if attempt == 9:
                raise
            time.sleep(5)
    out = {}
    for line in text.splitlines():
        if line.startswith(f"jaxspec:{name}{{"):
            labels, value = line[len(name) + 9 :].rsplit(" ", 1)
            out[labels.rstrip("}")] = float(value)
    c.close()
    return out


def shape_rounds(port) -> dict[str, float]:
    """Rounds the server ran so far with each tree shape ("off": plain steps)."""
    v = metric_values(port, "spec_shape_rounds_total")
    return {k.split('shape="')[1].rstrip('"'): x for k, x in v.items()}


def wait_background(ports, timeout: float) -> float:
    """Waits until no server has background compiles left; returns the seconds waited."""
    t = time.time()
    while time.time() - t < timeout:
        left = sum(sum(metric_values(p, "background_compile_remaining").values()) for p in ports)
        if left == 0:
            break
        time.sleep(5)
    return time.time() - t


def stream_chat(port, body: dict, timeout: float = 600):
    """Sends a streaming chat completion; yields each SSE event (a dict) as it arrives."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]}")
    try:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
    finally:
        c.close()


def flush(port) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/flush_cache")
    c.getresponse().read()
    c.close()


def conversations(args) -> list:
    """The level's requests: MT-bench first turns (str) or bench_repetitive.py's conversations."""
    if args.workload == "mtbench":
        return mtbench_first_turns(max(args.requests, 2) + 1)[1:]
    import bench_repetitive as rep

    build = {"code": rep.code_edits, "quote": rep.quote_passages, "agent": rep.agent_loop}[args.workload]
    return build(args.requests, args.seed)


def one_request(port, question, args, temperature):
    """question: a user turn (str) or a whole conversation (messages)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}] if isinstance(question, str) else question,
        "max_tokens": args.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"ignore_eos": True} if args.ignore_eos else {}),
    }
    t0 = time.perf_counter()
    ttft = last = None
    gaps = []  # seconds between consecutive content chunks: how smooth the stream is
    tokens = verify = plain = 0
    for ev in stream_chat(port, body):
        if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if "spec_metrics" in ev:
            verify = ev["spec_metrics"]["spec_verify_ct"]
            plain = ev["spec_metrics"].get("spec_plain_steps", 0)
    return time.perf_counter() - t0, ttft, tokens, verify, gaps, plain


def run_level(port, questions, conc, temperature, args):
    todo: queue.Queue = queue.Queue()
    for q in questions[: args.requests]:
        todo.put(q)
    rows, lock = [], threading.Lock()
    deadline = time.perf_counter() + args.time_limit

    def worker():
        while time.perf_counter() < deadline:
            try:
                q = todo.get_nowait()
            except queue.Empty:
                return
            res = one_request(port, q, args, temperature)
            with lock:
                rows.append(res)

    t = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    wall = time.perf_counter() - t
    lat = np.array([r[0] for r in rows])
    ttft = np.array([r[1] for r in rows if r[1] is not None])
    tokens = sum(r[2] for r in rows)
    verify = sum(r[3] for r in rows)
    plain = sum(r[5] for r in rows)  # adaptive speculation's plain steps: not rounds
    gaps = np.array([g for r in rows for g in r[4]])
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")
    return dict(
        concurrency=conc,
        temperature=temperature,
        requests=len(rows),
        wall_s=wall,
        tokens=tokens,
        tok_per_s=tokens / wall,
        accept=(tokens - plain) / verify if verify else float("nan"),
        lat_p50=pct(lat, 50),
        lat_p90=pct(lat, 90),
        lat_p99=pct(lat, 99),
        ttft_p50=pct(ttft, 50),
        ttft_p99=pct(ttft, 99),
        gap_p50=pct(gaps, 50),
        gap_p99=pct(gaps, 99),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["plain", "eagle3", "eagle3-static"], choices=sorted(MODES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at most)")
    ap.add_argument(
        "--time-limit", type=float, default=300, help="seconds per level before workers stop taking requests"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request generates --max-tokens (otherwise sampled lengths differ between modes, and with "
        "all requests of a level sent at once its wall time is the longest one's)",
    )
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="levels are run at each")
    ap.add_argument("--workload", default="mtbench", choices=WORKLOADS, help="what the requests ask (above)")
    ap.add_argument("--seed", type=int, default=0, help="fixes the conversations of --workload other than mtbench")
    add_model_arguments(ap, BENCH_CONTEXT)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed pass before each level")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra `jaxspec serve` flags (last)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    questions = conversations(args)
    eos = ", EOS ignored" if args.ignore_eos else ""
    print(f"# {machine()}\n# {args.workload}, max_tokens {args.max_tokens}{eos}, {args.requests} requests per level")
    print(
        "| mode | temperature | concurrency | requests | out tok/s | accept | latency p50 / p90 / p99 (s) | TTFT p50 / p99 (s) "
        "| stream gap p50 / p99 (ms) | rounds per shape |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    servers, results = {}, []
    try:
        for mode in args.modes:  # one at a time: start-up compiles use every core
            port = free_port()
            servers[mode] = (port, *start_server(MODES[mode], port, args))
        waited = wait_background([p for p, _, _ in servers.values()], args.startup_timeout)
        print(f"# background compiles finished {waited:.0f} s after the last server started")
        for temperature, conc in itertools.product(args.temperature, args.concurrency):
            if args.warmup:  # the same level untimed first: every shape it hits runs once here
                for port, _, _ in servers.values():
                    run_level(port, questions, conc, temperature, args)
                    flush(port)
            for mode, (port, _, startup) in servers.items():
                # programs a server was asked for (a call's own shape where a larger one served it)
                # compile while it is idle: not while another server's level is timed
                wait_background([p for p, _, _ in servers.values()], args.startup_timeout)
                before = shape_rounds(port)
                r = dict(mode=mode, startup_s=startup, **run_level(port, questions, conc, temperature, args))
                ran = {k: v - before.get(k, 0) for k, v in shape_rounds(port).items()}
                r["shape_rounds"] = ran
                results.append(r)
                total = sum(ran.values())
                shares = ", ".join(f"{k} {v / total:.0%}" for k, v in ran.items()) if total else "-"
                print(
                    f"| {mode} | {temperature:g} | {conc} | {r['requests']} | {r['tok_per_s']:.1f} | {r['accept']:.2f} | "
                    f"{r['lat_p50']:.2f} / {r['lat_p90']:.2f} / {r['lat_p99']:.2f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                    f"{1e3 * r['gap_p50']:.0f} / {1e3 * r['gap_p99']:.0f} | {shares} |",
                    flush=True,
                )
    finally:
        for _, p, _ in servers.values():
            p.terminate()
        for _, p, _ in servers.values():
            p.wait(120)
    with open(os.path.join(args.out, "serve.json"), "w") as f:
        json.dump(results, f, indent=1)
    level = lambda r: (r["temperature"], r["concurrency"])
    base = {level(r): r["tok_per_s"] for r in results if r["mode"] == "plain"}
    for r in results:
        if r["mode"] != "plain" and level(r) in base:
            print(
                f"# {r['mode']} / plain at temperature {r['temperature']:g}, concurrency {r['concurrency']}: "
                f"{r['tok_per_s'] / base[level(r)]:.2f}x"
            )


if __name__ == "__main__":
    main()

"""Mixed load on one `jaxspec serve` for a given time: memory, compiles and correctness over time.

    python benchmarks/bench_mixed_load.py [--minutes 30] [--concurrency 8] [--url http://127.0.0.1:30000]
        [--serve-args "..."] [--interval 60] [--bucket-words 20 120 500 2000 4500] [--kinds chat json ...]

Without --url it starts `jaxspec serve` (its defaults, plus --serve-args) on a free loopback port.
Every kind of request shares the server, as SGLang/vLLM users send them: chat (greedy, sampled),
streaming, completions, `n = 2`, logprobs, JSON schema (`response_format`), tools with
`tool_choice: "required"`, prompts of 300-900 words, prompts near the context length (rarely),
clients that disconnect mid-stream, invalid bodies and prefix-cache flushes. Before the load, each prompt-length bucket (one per KV span the server compiles)
is timed twice with different prompts of the same length: the first request of a bucket should
cost no more than the next (no compile, no first-run setup on the request path). Greedy probes run
at the start and at the end and must answer the same. Every --interval seconds it prints the
server's resident memory, memory maps and compiled programs (/get_server_info), compiles a
request waited for and grammar rejections (/metrics), and the window's latency percentiles.
Constrained outputs are checked (JSON parses and validates, tool calls parse); any 5xx counts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

from common import machine

from jaxspec.bench import mtbench_first_turns

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["name", "age", "hobbies"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
KINDS = (
    "chat",
    "sampled",
    "stream",
    "completion",
    "n2",
    "logprobs",
    "json",
    "tools",
    "long",
    "near-context",
    "leave",
    "invalid",
    "flush",
)
WEIGHTS = [4 if k not in ("near-context", "flush") else 1 for k in KINDS]  # prefill near the context takes minutes
PROBES = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


class Client:
    def __init__(self, host: str, port: int, key: str | None):
        self.host, self.port = host, port
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def conn(self, timeout: float = 600) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def call(self, method: str, path: str, body=None, raw: bytes | None = None):
        c = self.conn()
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        c.request(method, path, body=data, headers=self.headers)
        r = c.getresponse()
        text = r.read().decode()
        c.close()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text


def words(rng: random.Random, corpus: list[str], lo: int, hi: int) -> str:
    """A prompt of lo..hi words drawn from the corpus' questions."""
    n, out = rng.randint(lo, hi), []
    while len(out) < n:
        out += rng.choice(corpus).split()
    return " ".join(out[:n])


def body_for(kind: str, rng: random.Random, corpus: list[str], context: int = 8192) -> tuple[str, dict | None]:
    """(path, body) of one request of `kind` (context: the server's context length, in tokens)."""
    chat = lambda text, **kw: {"messages": [{"role": "user", "content": text}], "max_tokens": 96, **kw}
    q = rng.choice(corpus)
    if kind == "chat":
        return "/v1/chat/completions", chat(q, temperature=0)
    if kind == "sampled":
        return "/v1/chat/completions", chat(q, temperature=1.0, top_p=0.95)
    if kind in ("stream", "leave"):
        return "/v1/chat/completions", chat(q, temperature=rng.choice([0, 1.0]), stream=True)
    if kind == "completion":
        return "/v1/completions", {"prompt": q, "max_tokens": 64, "temperature": 0}
    if kind == "n2":
        return "/v1/chat/completions", chat(q, temperature=0.8, n=2, max_tokens=48)
    if kind == "logprobs":
        return "/v1/chat/completions", chat(q, temperature=0, logprobs=True, top_logprobs=3, max_tokens=48)
    if kind == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        return "/v1/chat/completions", chat(f"Describe a person as JSON. {q}", temperature=0, response_format=fmt)
    if kind == "tools":
        return "/v1/chat/completions", chat(
            "What is the weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0
        )
    if kind == "long":
        return "/v1/chat/completions", chat(
            f"Summarise these notes in two sentences.\n\n{words(rng, corpus, 300, 900)}", temperature=0
        )
    if kind == "near-context":  # MT-bench text is about 1.5 tokens per word: within about 1,000 tokens of the context
        n = max(context * 10 // 16 - 300, 50)
        return "/v1/completions", {"prompt": words(rng, corpus, n - 100, n), "max_tokens": 32, "temperature": 0}
    if kind == "flush":
        return "/flush_cache", {}
    return "/v1/chat/completions", None  # invalid


def check(kind: str, out: dict) -> str | None:
    """What is wrong with a 200 response's constrained content (None: nothing)."""
    import jsonschema

    if kind not in ("json", "tools"):
        return None
    ch = out["choices"][0]
    if ch.get("finish_reason") == "length":
        return None
    try:
        if kind == "json":
            jsonschema.validate(json.loads(ch["message"]["content"]), PERSON)
        elif kind == "tools":
            calls = ch["message"].get("tool_calls") or []
            assert calls, "no tool call"
            for c in calls:
                json.loads(c["function"]["arguments"])
    except Exception as e:  # reported with the kind
        return f"{kind}: {type(e).__name__}: {e}"[:300]
    return None


def metric(text: str, name: str) -> float:
    m = re.search(rf"^jaxspec:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(int(p / 100 * len(xs)), len(xs) - 1)] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--url", default=None, help="a running server (default: start `jaxspec serve` on loopback)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--serve-args", default="", help="flags for the server this script starts")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the kinds of request sent")
    ap.add_argument(
        "--bucket-words",
        type=int,
        nargs="*",
        default=[20, 120, 500, 2000, 4500],
        help="prompt lengths (words) whose first request is timed against a second before the load",
    )
    args = ap.parse_args()

    proc = None
    if args.url is None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "jaxspec.cli", "serve", "--port", str(port), *shlex.split(args.serve_args)]
        proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=sys.stderr, stderr=sys.stderr)
        args.url = f"http://127.0.0.1:{port}"
    u = urlparse(args.url)
    cl = Client(u.hostname or "127.0.0.1", u.port or 80, args.api_key)
    t0 = time.time()
    while True:
        try:
            if cl.call("GET", "/health")[0] == 200:
                break
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        time.sleep(2)
    print(f"machine: {machine()}; server ready after {time.time() - t0:.0f} s", flush=True)
    rng = random.Random(args.seed)
    corpus = mtbench_first_turns()
    context = int(cl.call("GET", "/get_server_info")[1].get("context_length") or 8192)

    def info() -> dict:
        return cl.call("GET", "/get_server_info")[1]["internal_states"][0]

    def sample(label: str, lat: list[float]) -> dict:
        mem = info().get("memory", {})
        m = cl.call("GET", "/metrics")[1]
        row = {
            "t": label,
            "rss_gib": mem.get("resident_bytes", 0) / 2**30,
            "maps": mem.get("memory_maps"),
            "programs": mem.get("programs"),
            "compiles_on_demand": metric(m, "num_compiles_on_demand_total"),
            "grammar_rejections": metric(m, "num_grammar_rejections_total"),
            "requests": len(lat),
            "p50": pct(lat, 50),
            "p90": pct(lat, 90),
            "p99": pct(lat, 99),
        }
        print(
            "| {t} | {rss_gib:.2f} | {maps} | {programs} | {compiles_on_demand:.0f} | {grammar_rejections:.0f} | "
            "{requests} | {p50:.1f} | {p90:.1f} | {p99:.1f} |".format(**row),
            flush=True,
        )
        return row

    def probes() -> list[str]:
        return [
            cl.call("POST", "/v1/chat/completions", {**body_for("chat", rng, [p])[1], "max_tokens": 32})[1]["choices"][
                0
            ]["message"]["content"]
            for p in PROBES
        ]

    # each prompt bucket: its first request against a second one of the same length
    print("\n| prompt words | first request (s) | second (s) | ratio |\n|---|---|---|---|", flush=True)
    buckets = []
    for n in args.bucket_words:
        ts = []
        for _ in range(2):
            body = {"prompt": words(rng, corpus, n, n), "max_tokens": 8, "temperature": 0}
            t = time.perf_counter()
            st, out = cl.call("POST", "/v1/completions", body)
            ts.append(time.perf_counter() - t)
            if st != 200:  # past the context: not a bucket this server serves
                break
        if len(ts) == 2:
            buckets.append(ts[0] / ts[1])
            print(f"| {n} | {ts[0]:.2f} | {ts[1]:.2f} | {ts[0] / ts[1]:.2f} |", flush=True)
    first = probes()

    print(
        "\n| t (min) | RSS (GiB) | memory maps | programs | compiles on demand | grammar rejections | requests | "
        "latency p50 (s) | p90 | p99 |\n|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    lock = threading.Lock()
    lat: list[float] = []
    counts = dict.fromkeys(KINDS, 0)
    errors: list[str] = []
    end = time.time() + args.minutes * 60
    sample("start", [])

    kinds = [k for k in KINDS if k in args.kinds]
    weights = [w for k, w in zip(KINDS, WEIGHTS) if k in kinds]

    def worker(seed: int):
        r = random.Random(seed)
        while time.time() < end:
            kind = r.choices(kinds, weights)[0]
            path, body = body_for(kind, r, corpus, context)
            t = time.perf_counter()
            try:
                if kind == "invalid":
                    st, out = cl.call("POST", path, raw=b'{"messages": [')
                    bad = None if st == 400 else f"invalid body: {st}"
                elif kind in ("stream", "leave"):
                    c = cl.conn()
                    c.request("POST", path, body=json.dumps(body), headers=cl.headers)
                    resp = c.getresponse()
                    bad = None if resp.status == 200 else f"{kind}: {resp.status}"
                    for i, line in enumerate(resp):
                        if (kind == "leave" and i >= 4) or line.strip() == b"data: [DONE]":
                            break
                    c.close()
                else:
                    st, out = cl.call("POST", path, body)
                    bad = f"{kind}: {st} {str(out)[:200]}" if st != 200 else check(kind, out)
            except Exception as e:  # a dropped connection or a timeout is a failure too
                bad = f"{kind}: {type(e).__name__}: {e}"
            with lock:
                counts[kind] += 1
                if kind not in ("invalid", "leave", "flush", "near-context"):
                    lat.append(time.perf_counter() - t)
                if bad:
                    errors.append(bad)

    threads = [
        threading.Thread(target=worker, args=(args.seed * 1000 + i,), daemon=True) for i in range(args.concurrency)
    ]
    for th in threads:
        th.start()
    start, seen = time.time(), 0
    while any(th.is_alive() for th in threads):
        left = end - time.time()
        if left > 0:
            time.sleep(min(args.interval, left))
        else:  # the last requests finishing
            for th in threads:
                th.join()
        with lock:
            window = lat[seen:]
            seen = len(lat)
        sample(f"{(time.time() - start) / 60:.1f}", window)
    last = probes()
    print(f"\nrequests by kind: {counts}")
    print(f"failures ({len(errors)}): {errors[:10]}")
    print(f"greedy probes identical at the start and the end: {first == last}")
    print(f"first request of a prompt bucket / the next: at most {max(buckets, default=float('nan')):.2f}x")
    if proc is not None:
        proc.terminate()
        proc.wait(60)
    return 0 if not errors and first == last else 1


if __name__ == "__main__":
    sys.exit(main())

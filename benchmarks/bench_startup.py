"""Start-up and first-request latency of `jaxspec generate` and `jaxspec serve`, cold (empty
persistent compilation cache) and warm (second start), and the TTFT of the first request of each
new prompt length after start-up against a second identical request.

    python benchmarks/bench_startup.py [--context-length N] [--model-path P] [--lengths 20 150 400 1500]

Runs the commands as a user would (subprocesses, default model + its shipped EAGLE-3 draft) with
JAXSPEC_COMPILATION_CACHE pointing at a fresh temporary directory; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

from common import add_model_arguments


def cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def timed_generate(env, model: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "jaxspec.cli", "generate", "--chat", "Say hi.", "--max-new-tokens", "16", *model],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = json.loads(c.getresponse().read())
    c.close()
    return r


def metrics(port) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return {
        ln.split("{")[0].split(":")[1]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("jaxspec:")
    }


def serve(env, ctx: int | None, model: list[str], lengths: list[int]) -> dict:
    port = free_port()
    argv = (
        [sys.executable, "-m", "jaxspec.cli", "serve", "--port", str(port)]
        + (["--context-length", str(ctx)] if ctx else [])
        + model
    )
    t = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if p.poll() is not None:
                raise SystemExit("jaxspec serve exited during start-up")
            time.sleep(0.2)
        out = {"startup_s": time.perf_counter() - t, "ttft": []}
        for n in lengths:
            ids = [(17 + 31 * i) % 40000 + 100 for i in range(n)]
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
            a = post(port, "/generate", body)["meta_info"]["ttft"]
            b = post(port, "/generate", body)["meta_info"]["ttft"]
            out["ttft"].append((n, a, b))
        m = metrics(port)
        out["on_demand"] = m.get("num_compiles_on_demand_total")
        out["background_left"] = m.get("background_compile_remaining")
        while metrics(port).get("background_compile_remaining", 0) > 0 and time.perf_counter() - t < 1800:
            time.sleep(2)
        out["background_done_s"] = time.perf_counter() - t
        return out
    finally:
        p.terminate()
        p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap, None)  # the default server: the model's own context
    ap.add_argument("--lengths", type=int, nargs="+", default=[20, 150, 400, 1500])
    ap.add_argument("--skip-generate", action="store_true")
    args = ap.parse_args()
    model = ["--model-path", args.model_path] if args.model_path else []
    cache = tempfile.mkdtemp(prefix="jaxspec-xla-")
    env = dict(os.environ, JAXSPEC_COMPILATION_CACHE=cache, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    print(f"CPU: {cpu()} ({os.cpu_count()} cores); compilation cache {cache}", flush=True)
    if not args.skip_generate:
        g1, g2 = timed_generate(env, model), timed_generate(env, model)
        print(
            f"| `jaxspec generate --chat 'Say hi.' --max-new-tokens 16` wall | cold {g1:.1f} s | warm {g2:.1f} s |",
            flush=True,
        )
    for label in ("cold", "warm"):
        r = serve(env, args.context_length, model, args.lengths)
        print(
            f"| `jaxspec serve` ({label} cache) until /health | {r['startup_s']:.1f} s | compiles on demand after: {r['on_demand']:.0f}; "
            f"background shapes left: {r['background_left']:.0f}; background compile done {r['background_done_s']:.0f} s after launch |",
            flush=True,
        )
        for n, a, b in r["ttft"]:
            print(
                f"|   prompt {n} tokens ({label}) | TTFT first {a:.3f} s | second {b:.3f} s | ratio {a / b:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

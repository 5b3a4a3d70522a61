"""`jaxspec serve --dp-size N`: replicas behind SGLang's router (server/replicas.py).

Fast: the checks that run before any weights load (a message that says what to do), the flags a
replica is started with, and the routes the router reads. Slow (end to end, the real router): two
replicas + router on CPU answer the openai SDK like one server alone; a replica killed under load
costs no request and comes back; multi-turn chats land where their prefix is cached.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxspec.args import EngineArgs, ServerArgs
from jaxspec.cli import build_parser, main
from jaxspec.cli_flags import from_namespace, to_argv
from jaxspec.server import replicas

from helpers import free_port, model_dirs, serve_subprocess  # noqa: F401  (fixture)


def serve_error(capsys, *flags: str) -> str:
    """`jaxspec serve FLAGS`'s one-line error (exit code 2, no traceback, no model loaded)."""
    assert main(["serve", "--model-path", "/nonexistent/model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxspec: error: ") and "Traceback" not in err, err
    return err


def test_bad_dp_flags_fail_before_loading(capsys, monkeypatch):
    assert "--dp-size must be >= 1" in serve_error(capsys, "--dp-size", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    free = str(free_port())  # (not the default port: a server may be running there)
    with monkeypatch.context() as m:  # the replicas' ports free (another test's server may take one meanwhile)
        m.setattr(replicas, "port_free", lambda host, port: True)
        assert "need a core each; this process may use 2" in serve_error(capsys, "--dp-size", "3", "--port", free)
        assert "needs GPUs" in serve_error(capsys, "--dp-size", "2", "--tp-size", "2", "--port", free)
    with socket.socket() as s:  # the router's port in use
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert f"--port {port} is in use" in serve_error(capsys, "--dp-size", "2", "--port", str(port))
    real = replicas.importlib.util.find_spec
    monkeypatch.setattr(replicas.importlib.util, "find_spec", lambda n: None if n == "sglang_router" else real(n))
    assert "pip install sglang-router" in serve_error(capsys, "--dp-size", "2")


def test_a_replica_gets_the_groups_flags_on_its_own_port():
    ns = build_parser().parse_args(
        ["serve", "--context-length", "512", "--speculative-algorithm", "NONE", "--dp-size", "2", "--port", "9000"]
        + ["--api-key", "k", "--disable-radix-cache", "--router-policy", "round_robin"]
    )
    eng, srv = from_namespace(EngineArgs, ns), from_namespace(ServerArgs, ns)
    argv = replicas.replica_argv(eng, srv, 9001)
    assert argv[:4] == [sys.executable, "-m", "jaxspec.cli", "serve"]
    again = build_parser().parse_args(argv[3:])
    assert from_namespace(EngineArgs, again) == eng
    own = from_namespace(ServerArgs, again)
    assert (own.port, own.host, own.dp_size, own.api_key, own.disable_radix_cache) == (9001, "127.0.0.1", 1, "k", True)
    router = replicas.router_argv(srv, [replicas.Replica(0, 9001, {}, None), replicas.Replica(1, 9002, {}, None)])
    assert router[router.index("--worker-urls") + 1 : router.index("--worker-urls") + 3] == [
        "http://127.0.0.1:9001",
        "http://127.0.0.1:9002",
    ]
    assert router[router.index("--policy") + 1] == "round_robin" and "--api-key" in router


def test_to_argv_round_trips_every_kind_of_flag():
    ns = build_parser().parse_args(["serve"])
    srv = from_namespace(ServerArgs, ns)
    assert to_argv(srv) == []  # all defaults
    changed = dataclasses.replace(srv, port=1234, disable_cuda_graph=True, max_request_bytes=5)
    # a --x / --no-x switch set either way, a number, a choice
    eng = dataclasses.replace(
        from_namespace(EngineArgs, ns), speculative_adaptive=False, context_length=300, quantization="int8"
    )
    again = build_parser().parse_args(["serve", *to_argv(eng), *to_argv(changed)])
    assert from_namespace(ServerArgs, again) == changed and from_namespace(EngineArgs, again) == eng


# ---- end to end, with the real router --------------------------------------------------------------


def _post(port: int, path: str, body: dict, timeout: float = 120) -> tuple[int, dict | str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text = r.read().decode()
    try:
        return r.status, json.loads(text)
    except json.JSONDecodeError:
        return r.status, text


def _requests_of(port: int) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    line = next(x for x in text.splitlines() if x.startswith("jaxspec:num_requests_total"))
    return int(float(line.split()[-1]))


def _group(flags: list[str]) -> tuple[subprocess.Popen, int]:
    """`jaxspec serve --dp-size 2 FLAGS` once its router answers /v1/models."""
    port = free_port()
    while not all(replicas.port_free("127.0.0.1", port + i) for i in range(3)):
        port = free_port()
    return serve_subprocess(["--dp-size", "2", *flags], port=port, ready="/v1/models", timeout=600)


def _stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(90)
    except subprocess.TimeoutExpired:
        p.kill()
        raise


PROMPTS = [f"Request {i}: " + "count the colours of the rainbow " * (1 + i % 3) for i in range(32)]


@pytest.mark.slow
def test_two_replicas_behind_the_router(model_dirs):  # noqa: F811
    """The openai SDK through the router (chat, stream, completions), 32 concurrent requests with
    greedy answers identical to one server alone; a replica killed with SIGKILL under load costs
    no request (the router retries on the other), comes back, and serves again; multi-turn chats
    find their prefix cached on >= 80% of later turns; SIGTERM stops the whole group."""
    from openai import OpenAI

    flags = ["--model-path", model_dirs["target"], "--context-length", "1024", "--disable-background-compile"]
    flags += ["--log-level", "warning"]
    alone, alone_port = serve_subprocess(flags)
    try:
        want = [
            _post(alone_port, "/v1/completions", {"model": "target", "prompt": p, "max_tokens": 16, "temperature": 0})
            for p in PROMPTS
        ]
    finally:
        alone.send_signal(signal.SIGTERM)
        alone.wait(60)
    group, port = _group(flags + ["--router-policy", "round_robin"])
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.chat.completions.create(
            model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
        )
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        pieces = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
            )
            if c.choices
        ]
        assert "".join(pieces) == r.choices[0].message.content
        done = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=16, temperature=0)
        assert done.choices[0].text == want[0][1]["choices"][0]["text"]

        def one(p):
            return _post(port, "/v1/completions", {"model": "target", "prompt": p, "max_tokens": 16, "temperature": 0})

        with cf.ThreadPoolExecutor(32) as ex:
            got = list(ex.map(one, PROMPTS))
        assert [g[0] for g in got] == [200] * 32
        assert [g[1]["choices"][0]["text"] for g in got] == [w[1]["choices"][0]["text"] for w in want]
        ports = (port + 1, port + 2)
        assert all(_requests_of(x) > 0 for x in ports)  # both replicas served

        # SIGKILL one replica under load: every request still answered (in time), the replica returns
        victim = next(
            int(x.split()[0])
            for x in subprocess.run(
                ["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True
            ).stdout.splitlines()
            if f"--port {ports[0]}" in x and "jaxspec.cli serve" in x
        )
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(one, p) for p in PROMPTS * 4]
            time.sleep(0.2)
            os.kill(victim, signal.SIGKILL)
            results = [f.result(timeout=180) for f in futs]
        assert [r[0] for r in results] == [200] * len(results), [r for r in results if r[0] != 200][:3]
        t = time.time()
        while _requests_of_safe(ports[0]) is None:
            assert time.time() - t < 300, "the killed replica did not come back"
            time.sleep(2)
        time.sleep(12)  # the router's health check takes it back
        before = _requests_of(ports[0])
        with cf.ThreadPoolExecutor(8) as ex:
            assert [r[0] for r in ex.map(one, PROMPTS)] == [200] * 32
        assert _requests_of(ports[0]) > before  # served by both again
    finally:
        _stop(group)
    assert group.returncode == 0

    group, port = _group(flags)  # cache-aware routing (the default policy)
    try:
        hits = later = 0
        for k in range(6):
            msgs = [{"role": "system", "content": f"You are assistant {k}. " + "Answer briefly. " * 12}]
            for turn in range(4):
                msgs.append({"role": "user", "content": f"Turn {turn} of chat {k}: " + "tell me more " * 4})
                status, d = _post(
                    port,
                    "/v1/chat/completions",
                    {"model": "target", "messages": msgs, "max_tokens": 12, "temperature": 0},
                )
                assert status == 200, d
                msgs.append({"role": "assistant", "content": d["choices"][0]["message"]["content"]})
                if turn:
                    later += 1
                    hits += d["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert hits >= 0.8 * later, (hits, later)
    finally:
        _stop(group)


def _requests_of_safe(port: int) -> int | None:
    try:
        return _requests_of(port)
    except (OSError, StopIteration):
        return None

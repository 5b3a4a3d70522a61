"""`jaxspec serve` end to end: a real uvicorn server (in a thread) over tiny random models that
use SmolLM2's tokenizer and chat template, spoken to over HTTP.

Checked: chat / completions / generate, streaming and not, concurrent requests token-identical to
the same request served alone, every error status (400, 401, 404, 413, 503), client disconnect
freeing its slot, metrics and server info, and SIGTERM finishing an in-flight stream.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest

from helpers import KEY, Server, model_dirs, serve_subprocess, start  # noqa: F401 - model_dirs is a fixture


@pytest.fixture(scope="module")
def spec_server(model_dirs):  # noqa: F811
    s = start(
        model_dirs,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=model_dirs["draft"],
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
        max_running_requests=4,
        max_queued_requests=6,
        disable_cuda_graph=True,  # compile on first use: only the shapes these tests meet
        max_request_bytes=4096,
    )
    yield s
    s.stop()


GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Name three colours."}]


def test_chat_completion_and_usage(spec_server):
    st, r, _ = spec_server.request("POST", "/v1/chat/completions", {"model": "default", "messages": CHAT, **GREEDY})
    assert st == 200, r
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["finish_reason"] == "length"
    u = r["usage"]
    assert u["completion_tokens"] == 12 and u["total_tokens"] == u["prompt_tokens"] + 12 and u["prompt_tokens"] > 5
    m = r["spec_metrics"]
    assert (
        m["speculative"]
        and m["spec_verify_ct"] >= 1
        and m["spec_accept_length"] == pytest.approx(12 / m["spec_verify_ct"])
    )


def test_streaming_matches_non_streaming(spec_server):
    body = {"model": "target", "messages": CHAT, **GREEDY, "stream_options": {"include_usage": True}}
    _, full, _ = spec_server.request("POST", "/v1/chat/completions", body)
    ev = spec_server.stream("/v1/chat/completions", body)
    assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev if e["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert ev[-2]["choices"][0]["finish_reason"] == "length" and "spec_metrics" in ev[-2]
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] == 12


def test_completions_and_generate(spec_server):
    st, c, _ = spec_server.request("POST", "/v1/completions", {"prompt": "Once upon a time", **GREEDY})
    assert st == 200 and c["object"] == "text_completion"
    ev = spec_server.stream("/v1/completions", {"prompt": "Once upon a time", **GREEDY})
    assert "".join(e["choices"][0]["text"] for e in ev) == c["choices"][0]["text"]
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    st, g, _ = spec_server.request("POST", "/generate", {"text": "Once upon a time", "sampling_params": sp})
    assert st == 200 and g["text"] == c["choices"][0]["text"]
    assert g["meta_info"]["spec_verify_ct"] >= 1 and g["meta_info"]["spec_accept_length"] > 0
    ev = spec_server.stream("/generate", {"input_ids": [1, 2, 3], "sampling_params": sp})
    assert ev[-1]["meta_info"]["completion_tokens"] == 12 and ev[-1]["output_ids"] == ev[-2]["output_ids"]


def test_concurrent_greedy_identical_to_alone(spec_server):
    prompts = [[5 + i] * (3 + 7 * i) for i in range(7)]  # 7 requests > 4 slots: queueing and slot reuse
    alone = []
    for p in prompts:
        _, r, _ = spec_server.request(
            "POST",
            "/generate",
            {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 16 + len(p) % 5}},
        )
        alone.append(r["output_ids"])
    together = [None] * len(prompts)

    def go(i):
        _, r, _ = spec_server.request(
            "POST",
            "/generate",
            {
                "input_ids": prompts[i],
                "sampling_params": {"temperature": 0, "max_new_tokens": 16 + len(prompts[i]) % 5},
            },
        )
        together[i] = r["output_ids"]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert together == alone
    # a request may turn speculation off for itself and still get the same greedy tokens
    _, r, _ = spec_server.request(
        "POST",
        "/generate",
        {
            "input_ids": prompts[2],
            "speculative": False,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16 + len(prompts[2]) % 5},
        },
    )
    assert r["output_ids"] == alone[2] and r["meta_info"]["speculative"] is False


def test_seeded_sampling_is_reproducible_and_penalties_run(spec_server):
    body = {"prompt": "Hello", "max_tokens": 10, "temperature": 1.0, "seed": 7}
    a = spec_server.request("POST", "/v1/completions", body)[1]["choices"][0]["text"]
    b = spec_server.request("POST", "/v1/completions", body)[1]["choices"][0]["text"]
    assert a == b
    st, r, _ = spec_server.request(
        "POST", "/v1/completions", {**body, "frequency_penalty": 1.0, "presence_penalty": 0.5}
    )
    assert st == 200 and r["spec_metrics"]["speculative"] is False  # penalties decode without speculation


def test_stop_strings(spec_server):
    _, r, _ = spec_server.request("POST", "/v1/completions", {"prompt": "Once upon a time", **GREEDY, "max_tokens": 30})
    text = r["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    _, s, _ = spec_server.request(
        "POST", "/v1/completions", {"prompt": "Once upon a time", **GREEDY, "max_tokens": 30, "stop": [stop]}
    )
    assert s["choices"][0]["finish_reason"] == "stop" and s["choices"][0]["matched_stop"] == stop
    assert s["choices"][0]["text"] == text[: text.index(stop)]
    ev = spec_server.stream("/v1/completions", {"prompt": "Once upon a time", **GREEDY, "max_tokens": 30, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in ev) == text[: text.index(stop)]


@pytest.mark.parametrize(
    "path,body,status,match",
    [
        ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "gpt-4"),
        ("/v1/completions", {"prompt": "hi " * 300}, 400, "context length"),
        ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "token ids"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "bogus"),
        ("/generate", {"sampling_params": {}}, 400, "exactly one"),
        # each of these once reached the engine (500, or a scheduler crash that took the server down)
        ("/v1/chat/completions", {"messages": CHAT, "seed": 2**64}, 400, "seed"),
        ("/v1/chat/completions", {"messages": CHAT, "seed": -(2**63) - 1}, 400, "seed"),
        ("/generate", {"text": "hi", "sampling_params": {"seed": 2**64}}, 400, "seed"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": "abc"}}, 400, "top_k"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": {"a": 1}}}, 400, "temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": "x"}}, 400, "stop_token_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [2**40]}}, 400, "stop_token_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [10**7]}}, 400, "stop_token_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": [1, 2]}}, 400, "repetition_penalty"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**40}}, 400, "top_k"),
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, 400, "json_schema"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": True}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, 400, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "g"},
            400,
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 1}, 400, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "image_url",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ],
)
def test_bad_input_is_an_openai_error(spec_server, path, body, status, match):
    st, r, _ = spec_server.request("POST", path, body)
    assert st == status and match in r["error"]["message"], r
    assert "Traceback" not in json.dumps(r)


def test_largest_seeds_are_served_and_the_server_stays_up(spec_server):
    """64-bit seeds (signed or unsigned) are folded into the PRNG key; once, 2**64 crashed the scheduler."""
    outs = []
    for seed in (2**64 - 1, -(2**63), 2**32 + 7, 7):
        st, r, _ = spec_server.request(
            "POST", "/v1/chat/completions", {"messages": CHAT, "seed": seed, "max_tokens": 6}
        )
        assert st == 200, r
        outs.append(r["choices"][0]["message"]["content"])
    st, r, _ = spec_server.request(
        "POST", "/v1/chat/completions", {"messages": CHAT, "seed": 2**32 + 7, "max_tokens": 6}
    )
    assert r["choices"][0]["message"]["content"] == outs[2]  # reproducible
    st, _, _ = spec_server.request("GET", "/health")
    assert st == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "top_p": Infinity}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "\xff\xfe"}',
        b"[" * 100000 + b"]" * 100000,
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        b'"just a string"',
    ],
)
def test_non_json_bodies_are_400(spec_server, raw):
    st, r, _ = spec_server.request("POST", "/v1/completions", raw=raw, headers={"Content-Length": str(len(raw))})
    assert st in (400, 413) and r["error"]["message"], r


def test_openapi_documents_request_bodies(spec_server):
    st, doc, _ = spec_server.request("GET", "/openapi.json")
    assert st == 200
    schemas = doc["components"]["schemas"]
    for path, name in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/generate", "GenerateRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert name in schemas
    assert schemas["SamplingParams"]["properties"]["top_k"]["minimum"] == -1
    assert "seed" in schemas["ChatCompletionRequest"]["properties"]
    refs = [m for m in json.dumps(doc).split('"$ref": "')[1:]]
    for ref in refs:  # every reference resolves
        name = ref.split('"')[0].rsplit("/", 1)[-1]
        assert name in schemas, name


def test_a_failing_request_does_not_take_the_server_down(spec_server, monkeypatch):
    """A program that fails for one request fails that request (500 JSON, counted); a failure that
    loses the device state re-creates it; either way the next request is served and /health is ok."""
    import jax

    progs = spec_server.sched.programs
    real_get = progs.get
    calls = {"finish": 0, "dispatch": 0}

    def flaky_get(key):
        prog = real_get(key)
        if key[0] == "finish" and calls["finish"] == 0:
            calls["finish"] += 1
            raise RuntimeError("injected admission failure")
        if key[0] == "dispatch" and calls["finish"] == 1 and calls["dispatch"] == 0:
            calls["dispatch"] += 1

            def lose_state(models, batch, kill):
                jax.tree_util.tree_map(lambda x: x.delete(), batch)  # as if donated to a program that then failed
                raise RuntimeError("injected device failure")

            return lose_state
        return prog

    monkeypatch.setattr(progs, "get", flaky_get)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    st, r, _ = spec_server.request("POST", "/generate", body)
    assert st == 500 and "injected admission failure" in r["error"]["message"], r
    st, r, _ = spec_server.request("POST", "/generate", body)
    assert st == 500 and "injected device failure" in r["error"]["message"], r
    st, r, _ = spec_server.request("POST", "/generate", body)
    assert st == 200 and r["meta_info"]["completion_tokens"] == 8, r
    st, text, _ = spec_server.request("GET", "/health")
    assert st == 200 and "re-created 1 times" in text
    _, text, _ = spec_server.request("GET", "/metrics")
    vals = {ln.split("{")[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("jaxspec:")}
    assert vals["jaxspec:num_requests_failed_total"] >= 2 and vals["jaxspec:num_recoveries_total"] == 1


def test_malformed_json_and_oversized_body(spec_server):
    st, r, _ = spec_server.request("POST", "/v1/completions", raw=b"{not json")
    assert st == 400 and "error" in r
    st, r, _ = spec_server.request("POST", "/v1/completions", raw=json.dumps({"prompt": "x" * 5000}).encode())
    assert st == 413 and "limit" in r["error"]["message"]


def test_api_key(spec_server):
    st, r, _ = spec_server.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert st == 401 and r["error"]["type"] == "AuthenticationError"
    st, r, _ = spec_server.request("GET", "/health", headers={"Authorization": ""})
    assert st == 200
    st, r, _ = spec_server.request("GET", "/v1/models")
    assert st == 200 and r["data"][0]["id"] == "target"


@pytest.mark.slow
def test_200_concurrent_requests_get_an_answer_or_a_retry_after(spec_server):
    """Overload: 200 clients at once against 4 slots and a queue of 6. Every one gets its answer
    or 503 with Retry-After, well within its timeout (none hangs, none is reset), and the server
    serves normally afterwards."""
    body = {"model": "default", "prompt": "count: 1 2 3", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def one(_):
        t = time.time()
        try:
            c = http.client.HTTPConnection("127.0.0.1", spec_server.port, timeout=120)
            c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
            r = c.getresponse()
            data = json.loads(r.read())
            return r.status, r.getheader("Retry-After"), data, time.time() - t
        except Exception as e:  # a reset or a timeout fails the test below
            return None, None, repr(e), time.time() - t

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(200) as ex:
        results = list(ex.map(one, range(200)))
    bad = [r for r in results if r[0] not in (200, 503)]
    assert not bad, bad[:3]
    busy = [r for r in results if r[0] == 503]
    done = [r for r in results if r[0] == 200]
    assert done and busy and all(r[2]["usage"]["completion_tokens"] == 8 for r in done)
    print(f"{len(done)} answered, {len(busy)} told to retry; slowest {max(r[3] for r in results):.1f} s")
    assert all(r[1] == "1" and r[2]["error"]["type"] == "ServiceUnavailable" for r in busy), busy[:3]
    assert max(r[3] for r in results) < 120
    st, r, _ = spec_server.request("POST", "/v1/completions", body)
    assert st == 200 and r["choices"][0]["text"] == done[0][2]["choices"][0]["text"]


def test_full_queue_is_503_and_disconnect_cancels(spec_server):
    sched = spec_server.sched
    aborted = sched.stats.aborted
    long = {
        "input_ids": [3] * 8,
        "sampling_params": {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True},
        "stream": True,
    }
    conns, statuses = [], []
    for _ in range(sched.slots + sched.max_queued + 3):  # more than slots + queue at once
        c = http.client.HTTPConnection("127.0.0.1", spec_server.port, timeout=60)
        c.request("POST", "/generate", body=json.dumps(long), headers={"Authorization": f"Bearer {KEY}"})
        conns.append(c)
    for c in conns:
        r = c.getresponse()
        statuses.append((r.status, r.getheader("Retry-After"), r.read().decode() if r.status != 200 else r.readline()))
    busy = [x for x in statuses if x[0] == 503]
    assert busy and all(x[1] == "1" and "max-queued-requests" in x[2] for x in busy), statuses
    for c in conns:  # the streaming clients hang up mid-stream
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
    t = time.time()
    while sched.running or sched.queue_depth:
        assert time.time() - t < 60, (sched.running, sched.queue_depth)
        time.sleep(0.05)
    assert sched.stats.aborted > aborted  # cancelled, not run to the end
    st, r, _ = spec_server.request(
        "POST", "/generate", {**long, "stream": False, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    )
    assert st == 200 and r["meta_info"]["completion_tokens"] == 4  # the slots are usable again


def test_metrics_and_server_info(spec_server):
    spec_server.request("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    st, text, _ = spec_server.request("GET", "/metrics")
    assert st == 200
    vals = {ln.split("{")[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("jaxspec:")}
    for k in (
        "num_requests_total",
        "generation_tokens_total",
        "gen_throughput",
        "spec_accept_length",
        "num_queue_reqs",
        "num_running_reqs",
    ):
        assert f"jaxspec:{k}" in vals
    assert vals["jaxspec:num_requests_total"] >= 1 and vals["jaxspec:generation_tokens_total"] >= 8
    assert vals["jaxspec:spec_accept_length"] >= 1
    # STANDALONE with a draft of its own: adaptive speculation is off, every dispatch runs the tree shape
    shapes = [ln for ln in text.splitlines() if ln.startswith("jaxspec:spec_shape_rounds_total{")]
    assert len(shapes) == 1 and 'shape="2/2/4"}' in shapes[0] and float(shapes[0].split()[-1]) >= 1, shapes
    assert 'shape="off"' not in text and vals["jaxspec:spec_shape_dispatches_total"] >= 1
    st, info, _ = spec_server.request("GET", "/get_server_info")
    assert st == 200 and info["speculative_algorithm"] == "STANDALONE" and info["avg_spec_accept_length"] >= 1
    assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"]
    assert "api_key" not in info
    # what SGLang's router reads of a worker: /server_info and /model_info (the model named as served)
    st, again, _ = spec_server.request("GET", "/server_info")
    assert st == 200 and again["speculative_algorithm"] == "STANDALONE"
    for path in ("/get_model_info", "/model_info"):
        st, card, _ = spec_server.request("GET", path)
        assert st == 200 and card["is_generation"] and card["model_path"] == info["served_model_name"], card


def test_prefix_cache_over_http(spec_server):
    """A repeated long prompt is served from the prefix cache (usage.prompt_tokens_details and
    meta_info report it, /metrics counts it) with the same greedy answer; /flush_cache forgets it."""
    system = "You are a careful assistant. " * 16  # about 100 tokens: more than one 64-token chunk
    body = {"model": "default", "messages": [{"role": "system", "content": system}, *CHAT], **GREEDY}
    spec_server.request("GET", "/flush_cache")
    first, second = (spec_server.request("POST", "/v1/chat/completions", body)[1] for _ in range(2))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt = second["usage"]["prompt_tokens"]
    assert prompt > 100 and prompt - 64 <= second["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    _, text, _ = spec_server.request("GET", "/metrics")
    vals = {ln.split("{")[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("jaxspec:")}
    assert vals["jaxspec:cached_tokens_total"] >= prompt - 64 and 0 < vals["jaxspec:cache_hit_rate"] < 1
    st, msg, _ = spec_server.request("POST", "/flush_cache")
    assert st == 200 and "flushed" in msg
    _, third, _ = spec_server.request("POST", "/v1/chat/completions", body)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    gen = {"text": system, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    _, g1, _ = spec_server.request("POST", "/generate", gen)
    _, g2, _ = spec_server.request("POST", "/generate", gen)
    assert g1["meta_info"]["cached_tokens"] == 0 and g2["meta_info"]["cached_tokens"] > 0


def test_plain_server_and_overlap_off(model_dirs):  # noqa: F811
    """NONE + overlap off: same greedy tokens as the offline engine."""
    from jaxspec.engine import Engine

    s = start(
        model_dirs,
        speculative_algorithm="NONE",
        disable_overlap_schedule=True,
        disable_cuda_graph=True,
        max_running_requests=2,
    )
    try:
        ref = Engine(model_dirs["target"], show_progress=False, speculative_algorithm="NONE").generate(
            input_ids=[[4, 5, 6]], sampling_params={"temperature": 0, "max_new_tokens": 10}
        )[0]["output_ids"]
        _, r, _ = s.request(
            "POST", "/generate", {"input_ids": [4, 5, 6], "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
        )
        assert r["output_ids"] == ref and r["meta_info"]["spec_verify_ct"] == 10
    finally:
        s.stop()


def test_out_of_memory_is_a_clear_startup_error(model_dirs):  # noqa: F811
    from jaxspec.errors import JaxspecError

    with pytest.raises(JaxspecError, match=r"out of memory.*--context-length.*--max-running-requests"):
        start(model_dirs, mem_fraction_static=1e-9)


@pytest.mark.slow
def test_sigterm_finishes_inflight_stream(model_dirs):  # noqa: F811
    p, port = serve_subprocess(
        [
            "--model-path",
            model_dirs["target"],
            "--context-length",
            "512",
            "--speculative-algorithm",
            "NONE",
            "--disable-cuda-graph",
        ]
    )
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request(
            "POST",
            "/generate",
            body=json.dumps(
                {
                    "input_ids": [3, 4],
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
                }
            ),
        )
        r = c.getresponse()
        first = r.readline()
        while not first.strip():
            first = r.readline()
        p.send_signal(signal.SIGTERM)
        lines = [first.decode()] + [ln.decode() for ln in r]
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert lines[-2].strip() == "data: [DONE]" or lines[-1].strip() == "data: [DONE]"
        assert data[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(data[-1]["output_ids"]) == 300
        assert p.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its graceful shutdown
        log = p.stdout.read()
        assert "Traceback" not in log and "shutting down" in log.lower(), log
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_default_model_server_matches_offline_greedy(default_engine):
    """`make serve SERVE_ARGS="--dtype float32"` (SmolLM2 read as float32 + its shipped EAGLE-3 head,
    the default off the CPU): chat over HTTP gives the plain float32 engine's greedy tokens."""
    from jaxspec.cli import build_parser
    from jaxspec.server.launch import build

    app, sched = build(
        build_parser().parse_args(
            ["serve", "--dtype", "float32", "--context-length", "1024", "--cuda-graph-max-bs", "2"]
            + ["--log-level", "error"]
        ),
        progress=False,
    )
    assert sched.spec is not None and sched.spec.algorithm == "EAGLE3"
    s = Server(app, sched)
    try:
        msgs = [
            [{"role": "user", "content": q}] for q in ("What is the capital of France?", "Write a haiku about the sea.")
        ]
        ref = default_engine.chat(msgs, {"temperature": 0, "max_new_tokens": 48})
        out = [None, None]

        def go(i):
            out[i] = s.request(
                "POST", "/v1/chat/completions", {"messages": msgs[i], "temperature": 0, "max_tokens": 48}
            )[1]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for r, o in zip(ref, out):
            assert o["choices"][0]["message"]["content"] == r["text"]
            assert o["usage"]["completion_tokens"] == r["meta_info"]["completion_tokens"]
            m = o["spec_metrics"]  # adaptive speculation (on for the shipped draft) may run some plain steps
            off = m["spec_shapes"]["off"]  # plain steps, one token each; spec_verify_ct counts the rounds
            assert sum(m["spec_shapes"].values()) == m["spec_verify_ct"] + off and m["spec_verify_ct"] > 0
            assert (o["usage"]["completion_tokens"] - off) / m["spec_verify_ct"] > 1.2
    finally:
        s.stop()

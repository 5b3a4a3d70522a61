"""Constrained output under mixed load: every kind of request shares the server's dispatches.

Constrained requests (JSON schema, tools with tool_choice "required", regex, json_object) are
served at concurrency 8 among free, sampled, `n = 2`, logprob, penalised (plain decoding inside
the round), streamed-and-abandoned and invalid requests, on a speculative server (an EAGLE-3 head
with a small draft vocabulary, adaptive speculation on, so plain steps and rounds alternate).
Checked: no 5xx, every constrained output valid, no matcher ever refused an emitted token, and
greedy constrained outputs identical to the same requests served alone; on a server that compiled
its programs ahead (as `jaxspec serve` does by default), no request waited for a compile. Tiny random models: their
free output is noise, so only the masks make constrained output valid.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import re
import threading

import pytest
from test_structured import PERSON, REGEX, WEATHER

from helpers import KEY, model_dirs, save_eagle_head, start  # noqa: F401 - model_dirs is a fixture

pytestmark = pytest.mark.slow

WORDS = "the cat sat on a mat while dogs ran far away into the night and".split()
REQUESTS = 96
CONCURRENCY = 8


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module", params=["compile-on-first-use", "compile-ahead"])
def server(model_dirs, tmp_path_factory, request):  # noqa: F811
    with open(f"{model_dirs['target']}/config.json") as f:
        cfg = json.load(f)
    head = save_eagle_head(
        tmp_path_factory.mktemp("eagle3"), "EAGLE3", cfg, seed=1, draft_vocab=4096, scale=4.0, aux_layer_ids=[-1, 0, 1]
    )
    s = start(
        model_dirs,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        speculative_adaptive=True,
        max_running_requests=8,
        context_length=640,
        **({"disable_cuda_graph": True} if request.param == "compile-on-first-use" else {}),
    )
    yield s
    s.stop()


def _probes(rng: random.Random) -> list[dict]:
    """Greedy constrained chat bodies, one per kind, whose outputs must not depend on the company they keep."""
    msgs = lambda: [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    return [
        {"messages": msgs(), "temperature": 0, "max_tokens": 64, "response_format": fmt},
        {"messages": msgs(), "temperature": 0, "max_tokens": 64, "tools": [WEATHER], "tool_choice": "required"},
        {"messages": msgs(), "temperature": 0, "max_tokens": 32, "regex": REGEX},
        {"messages": msgs(), "temperature": 0, "max_tokens": 48, "response_format": {"type": "json_object"}},
    ]


def _constrained_ok(body: dict, out: dict) -> list[str]:
    """What is wrong with a constrained response (empty: nothing)."""
    import jsonschema

    bad = []
    for ch in out["choices"]:
        msg, why = ch["message"], ch["finish_reason"]
        if why == "length":  # cut by max_tokens: a prefix, not a whole value
            continue
        try:
            if "tools" in body:
                assert why == "tool_calls" and msg["tool_calls"], ch
                for call in msg["tool_calls"]:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
            elif "regex" in body:
                assert re.fullmatch(REGEX, msg["content"]), msg["content"]
            elif body["response_format"]["type"] == "json_schema":
                jsonschema.validate(json.loads(msg["content"]), PERSON)
            else:
                assert isinstance(json.loads(msg["content"]), dict), msg["content"]
        except Exception as e:  # collected, reported together
            bad.append(f"{body.get('regex') or body.get('tool_choice') or body['response_format']['type']}: {e!r}")
    return bad


def _free(rng: random.Random, i: int) -> dict:
    msgs = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 300)))}]
    base = {"messages": msgs, "max_tokens": rng.choice([8, 24, 64])}
    return [
        {**base, "temperature": 1.0, "top_p": 0.9, "n": 2},
        {**base, "temperature": 0, "logprobs": True, "top_logprobs": 3},
        {**base, "temperature": 0.7, "frequency_penalty": 0.5},
        {**base, "temperature": 0},
        {**base, "temperature": 1.0, "regex": REGEX},
        {**base, "temperature": 1.0, "tools": [WEATHER], "tool_choice": "required"},
    ][i % 6]


def test_constrained_output_holds_under_mixed_load(server):
    rng = random.Random(0)
    probes = _probes(rng)
    alone = []
    for body in probes:
        status, out, _ = server.request("POST", "/v1/chat/completions", body)
        assert status == 200, out
        assert not _constrained_ok(body, out)
        alone.append(out["choices"][0]["message"])

    lines = _Lines()
    logging.getLogger("jaxspec").addHandler(lines)
    work = []
    for i in range(REQUESTS):
        kind = i % 8
        if kind < 4:
            work.append(("probe", probes[kind]))
        elif kind == 4:
            work.append(("stream-and-leave", _free(rng, i)))
        elif kind == 5:
            work.append(("invalid", None))
        else:
            work.append(("request", _free(rng, i)))
    rng.shuffle(work)
    bad: list[str] = []
    got: list[tuple[int, dict]] = []
    it, lock = iter(work), threading.Lock()

    def client():
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                return
            what, body = item
            try:
                if what == "invalid":
                    status, out, _ = server.request("POST", "/v1/chat/completions", raw=b'{"messages": [')
                    if status != 400:
                        bad.append(f"invalid body: {status} {out}")
                    continue
                if what == "stream-and-leave":
                    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
                    c.request(
                        "POST",
                        "/v1/chat/completions",
                        body=json.dumps({**body, "stream": True}),
                        headers={"Authorization": f"Bearer {KEY}"},
                    )
                    r = c.getresponse()
                    r.fp.readline()
                    c.close()
                    continue
                status, out, _ = server.request("POST", "/v1/chat/completions", body)
                if status != 200:
                    bad.append(f"{status}: {out}")
                    continue
                constrained = any(k in body for k in ("response_format", "regex", "tools"))
                if constrained:
                    bad.extend(_constrained_ok(body, out))
                if what == "probe":
                    with lock:
                        got.append((probes.index(body), out["choices"][0]["message"]))
            except Exception as e:  # reported below
                bad.append(f"{what}: {e!r}")

    threads = [threading.Thread(target=client) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    logging.getLogger("jaxspec").removeHandler(lines)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not bad, bad[:5]
    refused = [m for m in lines.lines if "grammar" in m and ("rejected" in m or "stale" in m)]
    assert not refused, refused[:3]
    assert server.sched.stats.grammar_rejections == 0
    if not server.sched.programs.lazy:  # compiled ahead: every call found a program
        assert server.sched.programs.compiles_on_demand == 0
        status, info, _ = server.request("GET", "/get_server_info")
        mem = info["internal_states"][0]["memory"]
        assert status == 200 and mem["programs"] == server.sched.programs.memory.count > 0
        assert mem["kv_cache_bytes"] > 0 and mem["resident_bytes"] > 0 and mem["weights_bytes"] > 0
    assert len(got) == REQUESTS // 2
    for i, msg in got:  # greedy constrained output does not depend on the company it keeps
        ref = alone[i]
        if "tool_calls" in ref:
            assert [c["function"] for c in msg["tool_calls"]] == [c["function"] for c in ref["tool_calls"]]
        else:
            assert msg["content"] == ref["content"], (i, msg, ref)

"""`jaxspec serve` paths that tests/test_server.py leaves open, over real uvicorn servers.

Checked:
  * drafts are really accepted in the server: the tiny target served with itself as its
    STANDALONE draft (a chain, greedy) accepts every draft token, so each round emits
    num_steps + 1 tokens and n tokens take exactly ceil((n - 1) / (num_steps + 1)) rounds
    (the first token comes from the prefill): exact spec_verify_ct, spec_accept_length,
    spec_accept_histogram, stream chunking and the server's counters, on /generate,
    /v1/completions and /v1/chat/completions;
  * stop strings whose characters come from two consecutive generated tokens that arrive in
    two different stream deltas (found from a first greedy run's output_ids): the output ends
    exactly before the stop string, finish_reason stop / matched_stop, the stream never shows a
    character of it (non-streaming, OpenAI streaming, /generate streaming);
  * multi-byte UTF-8 (emoji, CJK) split across tokens and across stream deltas: a scripted model
    (a bigram lookup table) makes the real server emit chosen byte-level BPE tokens one per
    delta; no delta holds U+FFFD and the deltas add up to the full decode; the incremental
    detokenizer is also driven token by token on many strings; a stop string inside such a
    character;
  * the context edge with speculation on: prompts of context_length - 1, - 2 and - 11 tokens
    finish with "length", the right number of tokens, the offline plain-greedy tokens;
  * HTTP paths: 413 for a chunked body (no Content-Length) over --max-request-bytes, 401 on every
    route but /health without or with a wrong API key, a non-streaming client that hangs up
    (its request cancelled, its slot freed, counted as aborted in /metrics), 503 with a JSON
    error once the scheduler is shutting down (the in-flight stream ends with "abort" and
    [DONE]), and SIGTERM arriving mid-stream in a `jaxspec serve` subprocess with a STANDALONE
    draft (the stream still completes with [DONE], no traceback).
"""

from __future__ import annotations

import http.client
import itertools
import json
import signal
import socket
import threading
import time
import types

import pytest

from helpers import KEY, make_hf_model, serve_subprocess, start

S = 3  # speculative_num_steps of the self-drafting server (a chain: topk 1, num_draft_tokens S + 1)
K = 2  # --num-continuous-decode-steps: rounds per dispatch, i.e. per stream delta
CTX = 64  # context length of the self-drafting server
SCRIPT = "Hi 🦀 and 日本 ok."  # the scripted model's text: 🦀 and 日 are split over 3 tokens each
NEWLINE = 198  # the last token of SmolLM2's chat prompt ("<|im_start|>assistant\n")


def rounds(n: int) -> int:
    """Verification rounds for n tokens when every draft is accepted (the first token is the prefill's)."""
    return -(-(n - 1) // (S + 1))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from jaxspec.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path(progress=False))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tok):
    """The tiny random target of test_server.py, and a scripted model that continues SCRIPT.

    The scripted model is a bigram table: attention and MLP outputs are zeroed, so the final
    hidden state is the last token's embedding; token a's embedding is the unit vector e_i and
    lm_head row b is 10 e_i for the i-th pair (a, b), so greedy decoding after a emits b (logit
    80 against 0). Its text cycles: '.' is followed by SCRIPT's second token again, and so is
    the chat prompt's final newline."""
    import torch

    d = tmp_path_factory.mktemp("paths")
    kw = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    make_hf_model(
        "llama", 3, num_hidden_layers=2, initializer_range=0.2, max_position_embeddings=512, **kw
    ).save_pretrained(d / "target")
    tok.save_pretrained(d / "target")

    chain = tok.encode(SCRIPT, add_special_tokens=False)
    succ = dict(itertools.pairwise(chain))
    assert len(succ) == len(chain) - 1 and NEWLINE not in succ  # every token has one successor
    succ[chain[-1]] = succ[NEWLINE] = chain[1]
    m = make_hf_model("llama", 7, num_hidden_layers=1, max_position_embeddings=2048, **kw)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.model.embed_tokens.weight.zero_()
        m.lm_head.weight.zero_()
        m.model.norm.weight.fill_(1.0)
        for i, (a, b) in enumerate(succ.items()):
            m.model.embed_tokens.weight[a, i] = 1.0
            m.lm_head.weight[b, i] = 10.0
    m.save_pretrained(d / "scripted")
    tok.save_pretrained(d / "scripted")
    return {"target": str(d / "target"), "scripted": str(d / "scripted"), "chain": chain}


@pytest.fixture(scope="module")
def selfspec(dirs):
    """The tiny target with itself as its STANDALONE draft: every draft token is accepted."""
    s = start(
        dirs,
        context_length=CTX,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=dirs["target"],
        speculative_draft_model_quantization="unquant",  # the target itself (on CPU a draft runs in int8 by default)
        speculative_num_steps=S,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=S + 1,
        num_continuous_decode_steps=K,
        max_running_requests=2,
        disable_cuda_graph=True,
        max_request_bytes=4096,
    )
    st, _, _ = s.request(
        "POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 20, "temperature": 0}}
    )
    assert st == 200  # compiles the programs of short requests here, not in the first test
    yield s
    s.stop()


def scripted_server(dirs):
    """Plain decoding of the scripted model, one token per dispatch: one stream delta per token.
    Every dispatch reads the whole KV cache (the scheduler's min_span), so one program serves all
    lengths: no compile pauses a long request's stream of tokens."""
    s = start(
        {"target": dirs["scripted"]},
        speculative_algorithm="NONE",
        num_continuous_decode_steps=1,
        max_running_requests=2,
        context_length=2048,
        disable_cuda_graph=True,
    )
    s.sched.min_span = s.sched.max_len
    return s


@pytest.fixture(scope="module")
def scripted(dirs):
    s = scripted_server(dirs)
    yield s
    s.stop()


# ---- helpers ---------------------------------------------------------------------------------


def post(port, path, body=None, headers=None, chunks=None):
    """(status, parsed JSON or text, headers); `chunks` sends the body with Transfer-Encoding: chunked."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    if chunks is not None:
        c.request("POST", path, body=iter(chunks), headers=headers or {}, encode_chunked=True)
    else:
        c.request("POST", path, body=None if body is None else json.dumps(body), headers=headers or {})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(text), dict(r.getheaders())
    except json.JSONDecodeError:
        return r.status, text, dict(r.getheaders())


def sse(port, path, body):
    """(parsed events, whether the stream ended with [DONE])."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    events, done = [], False
    for line in r:
        line = line.decode().strip()
        if line == "data: [DONE]":
            done = True
            break
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    c.close()
    return events, done


def metric(server, name: str) -> float:
    _, text, _ = server.request("GET", "/metrics")
    return next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(f"jaxspec:{name}{{"))


def wait_for(cond, timeout: float, what):
    """Polls cond() until true; fails after timeout seconds with what() (or what)."""
    t = time.time()
    while not cond():
        assert time.time() - t < timeout, what() if callable(what) else what
        time.sleep(0.02)


def greedy(n, **kw):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **kw}


ONE = [5, 6, 7]  # prompt of the exact-histogram test
EDGE = [[(7 * i) % 500 + 100 for i in range(n)] for n in (CTX - 1, CTX - 2, CTX - 11)]  # prompts at the context edge


@pytest.fixture(scope="module")
def plain_greedy(dirs):
    """Offline plain greedy decoding of the target (no speculation) at the server's context length,
    of ONE (24 tokens) and of the EDGE prompts (as many tokens as fit): prompt tuple -> output ids."""
    from jaxspec.engine import Engine

    eng = Engine(dirs["target"], show_progress=False, speculative_algorithm="NONE", context_length=CTX)
    prompts = [ONE] + EDGE
    out = eng.generate(input_ids=prompts, sampling_params=[greedy(24)] + [greedy(CTX)] * len(EDGE))
    return {tuple(p): r["output_ids"] for p, r in zip(prompts, out)}


# ---- 1. drafts are really accepted -----------------------------------------------------------


@pytest.mark.slow
def test_self_draft_accepts_every_draft_token(selfspec, plain_greedy):
    """Every round of the self-drafting chain emits S + 1 tokens; the counts are exact."""
    sched = selfspec.sched
    vct0, tok0 = metric(selfspec, "spec_verify_ct_total"), sched.stats.spec_tokens
    prompts = [ONE, [9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4]]
    n = 24
    _, g, _ = selfspec.request("POST", "/generate", {"input_ids": prompts[0], "sampling_params": greedy(n)})
    m = g["meta_info"]
    assert m["speculative"] and m["completion_tokens"] == n and m["finish_reason"] == {"type": "length", "length": n}
    assert m["spec_verify_ct"] == rounds(n) == 6
    assert m["spec_accept_histogram"] == [0] * S + [rounds(n)]  # histogram[j]: rounds that emitted j + 1 tokens
    assert m["spec_accept_length"] == pytest.approx(n / rounds(n))
    assert g["output_ids"] == plain_greedy[tuple(ONE)]

    # streamed: the prefill's token alone, then one delta per dispatch of K rounds x (S + 1) tokens
    ev, done = sse(selfspec.port, "/generate", {"input_ids": prompts[0], "sampling_params": greedy(n)})
    sizes = [len(e["output_ids"]) for e in ev[:-1]]
    assert done and [b - a for a, b in zip([0] + sizes, sizes)] == [
        1,
        K * (S + 1),
        K * (S + 1),
        n - 1 - 2 * K * (S + 1),
    ]
    assert ev[-1]["output_ids"] == g["output_ids"] and ev[-1]["meta_info"]["spec_accept_histogram"] == [0] * S + [6]

    # the OpenAI routes report the same counts (n = 1 + 5 (S + 1): five full rounds)
    n2 = 1 + 5 * (S + 1)
    _, c, _ = selfspec.request(
        "POST", "/v1/completions", {"prompt": prompts[1], "temperature": 0, "max_tokens": n2, "ignore_eos": True}
    )
    sm = c["spec_metrics"]
    assert c["usage"]["completion_tokens"] == n2 and sm["spec_verify_ct"] == rounds(n2) == 5
    assert sm["spec_accept_histogram"] == [0] * S + [5] and sm["spec_accept_length"] == pytest.approx(n2 / 5)
    n3 = 13
    _, ch, _ = selfspec.request(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": n3, "ignore_eos": True},
    )
    assert ch["usage"]["completion_tokens"] == n3 and ch["spec_metrics"]["spec_verify_ct"] == rounds(n3) == 3
    assert ch["spec_metrics"]["spec_accept_histogram"] == [0] * S + [3]
    # a request that opts out decodes one token per round
    _, p, _ = selfspec.request(
        "POST", "/generate", {"input_ids": prompts[0], "speculative": False, "sampling_params": greedy(n)}
    )
    assert (
        p["output_ids"] == g["output_ids"]
        and p["meta_info"]["spec_verify_ct"] == n
        and "spec_accept_histogram" not in p["meta_info"]
    )

    total = rounds(n) * 2 + rounds(n2) + rounds(n3)
    assert metric(selfspec, "spec_verify_ct_total") - vct0 == total
    assert sched.stats.spec_tokens - tok0 == 2 * n + n2 + n3


# ---- 2. stop strings across two tokens and two deltas ----------------------------------------


def _stop_across_deltas(selfspec, tok):
    """(prompt, output_ids, text, b, stop): stop = the last character of token b - 1 and the first of
    token b, tokens that reached the client in different deltas of a greedy stream."""
    n = 32
    for prompt in ([11, 12, 13], [20, 21], [30, 31, 32, 33], [40]):
        ev, _ = sse(selfspec.port, "/generate", {"input_ids": prompt, "sampling_params": greedy(n)})
        ids, text = ev[-1]["output_ids"], ev[-1]["text"]
        for b in [len(e["output_ids"]) for e in ev[:-2]]:  # delta boundaries
            head, prev, nxt = tok.decode(ids[:b]), tok.decode(ids[: b - 1]), tok.decode(ids[: b + 1])
            p = len(head)
            if not (0 < p < len(text) and text.startswith(head) and text.startswith(nxt) and len(prev) < p < len(nxt)):
                continue  # the boundary is inside a character, or a token adds no text
            stop = text[p - 1 : p + 1]
            one = tok.encode(stop, add_special_tokens=False)
            if (
                stop.strip() != stop
                or "\ufffd" in stop
                or text.find(stop) != p - 1
                or (len(one) == 1 and one[0] in ids)
            ):
                continue  # want printable characters, the first occurrence, no single-token stop the device would see
            return prompt, ids, text, b, stop
    pytest.fail("no greedy output with a usable token / delta boundary")


def test_stop_string_across_two_tokens_and_two_deltas(selfspec, tok):
    prompt, ids, text, b, stop = _stop_across_deltas(selfspec, tok)
    want = text[: text.index(stop)]
    body = {"prompt": prompt, "temperature": 0, "max_tokens": len(ids), "ignore_eos": True, "stop": [stop]}
    _, r, _ = selfspec.request("POST", "/v1/completions", body)
    ch = r["choices"][0]
    assert ch["text"] == want and ch["finish_reason"] == "stop" and ch["matched_stop"] == stop
    assert r["usage"]["completion_tokens"] == b + 1  # through the token holding the stop string's last character

    _, g, _ = selfspec.request(
        "POST", "/generate", {"input_ids": prompt, "sampling_params": greedy(len(ids), stop=stop)}
    )
    assert g["output_ids"] == ids[: b + 1] and g["text"] == want
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    ev, done = sse(selfspec.port, "/v1/completions", body)
    pieces = [e["choices"][0]["text"] for e in ev]
    assert done and "".join(pieces) == want
    assert all(
        want.startswith("".join(pieces[: i + 1])) for i in range(len(pieces))
    )  # never a character of the stop string
    assert ev[-1]["choices"][0]["finish_reason"] == "stop" and ev[-1]["choices"][0]["matched_stop"] == stop

    ev, done = sse(selfspec.port, "/generate", {"input_ids": prompt, "sampling_params": greedy(len(ids), stop=stop)})
    assert done and all(want.startswith(e["text"]) for e in ev)
    # the delta that ended with token b - 1 held back its last character (it may start the stop string)
    assert [e["text"] for e in ev if len(e["output_ids"]) == b] == [text[: len(tok.decode(ids[:b])) - 1]]
    assert ev[-1]["output_ids"] == ids[: b + 1] and ev[-1]["meta_info"]["finish_reason"]["matched"] == stop


def test_streamed_output_ids_never_pass_a_stop_string(selfspec, tok):
    prompt, ids, text, b, stop = _stop_across_deltas(selfspec, tok)
    ev, _ = sse(selfspec.port, "/generate", {"input_ids": prompt, "sampling_params": greedy(len(ids), stop=stop)})
    final = ev[-1]["output_ids"]
    for e in ev[:-1]:
        assert final[: len(e["output_ids"])] == e["output_ids"] and e["meta_info"]["completion_tokens"] <= len(final), e


# ---- 3. multi-byte characters split across tokens and deltas ---------------------------------


def test_scripted_model_emits_split_characters_one_token_per_delta(scripted, dirs, tok):
    chain = dirs["chain"]
    out, want = chain[1:], SCRIPT[len("Hi") :]  # the model continues "Hi" with the rest of SCRIPT
    assert [tok.decode([t]) for t in out].count("\ufffd") >= 4  # 🦀 and 日 are split: their pieces decode to U+FFFD
    n = len(out)

    ev, done = sse(scripted.port, "/generate", {"input_ids": chain[:1], "sampling_params": greedy(n)})
    assert done and ev[-1]["output_ids"] == out and ev[-1]["text"] == want
    texts = [e["text"] for e in ev[:-1]]
    assert [len(e["output_ids"]) for e in ev[:-1]] == list(range(1, n + 1))  # one delta per token
    assert all("\ufffd" not in t and want.startswith(t) for t in texts)
    # a character is shown only once its last byte arrived: the deltas of its first pieces add no text
    assert texts[:3] == ["", "", " 🦀"] and texts[4:7] == [" 🦀 and"] * 2 + [" 🦀 and 日"]

    ev, done = sse(
        scripted.port, "/v1/completions", {"prompt": chain[:1], "max_tokens": n, "temperature": 0, "ignore_eos": True}
    )
    pieces = [e["choices"][0]["text"] for e in ev]
    assert done and "".join(pieces) == want and not any("\ufffd" in p for p in pieces)
    assert " 🦀" in pieces and " 日" in pieces  # each character whole in one delta

    ev, done = sse(
        scripted.port,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2 * n, "temperature": 0, "ignore_eos": True},
    )
    pieces = [e["choices"][0]["delta"].get("content", "") for e in ev if e["choices"]]
    assert done and "".join(pieces) == want * 2 and not any("\ufffd" in p for p in pieces)


def test_stop_string_inside_split_characters(scripted, dirs):
    """Stop strings made of characters split over several tokens (and deltas)."""
    chain = dirs["chain"]
    for stop, want in (("🦀", " "), ("日本", " 🦀 and "), ("本 o", " 🦀 and 日")):
        body = {"prompt": chain[:1], "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": stop}
        _, r, _ = scripted.request("POST", "/v1/completions", body)
        assert r["choices"][0]["text"] == want and r["choices"][0]["matched_stop"] == stop
        ev, done = sse(scripted.port, "/v1/completions", body)
        pieces = [e["choices"][0]["text"] for e in ev]
        assert done and "".join(pieces) == want and not any("\ufffd" in p for p in pieces)


DETOK_TEXTS = [
    "Hi 🦀 ok",
    "中文字符和日本語のテキスト",
    "😀👍🏽 family: 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "é̃ combining, ∑∫√ math, Ωμέγα",
    "mixed 🦀🦀🦀 and ✓✗ end",
    "한국어 텍스트 🎉",
    "a\u00a0b\u2028c tab\tnewline\n🙂",
]


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_incremental_detokenizer_never_splits_a_character(tok, per_step):
    """Scheduler._detok fed a few tokens at a time: no delta holds U+FFFD and the deltas add up to
    the full decode, with and without a stop string."""
    from jaxspec.sampling import SamplingParams
    from jaxspec.server.scheduler import Request, Scheduler

    fake = types.SimpleNamespace(eng=types.SimpleNamespace(tokenizer=tok), tok_lock=threading.Lock())
    for text in DETOK_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        for stop in (None, "🦀" if "🦀" in text else text[len(text) // 2 :][:2]):
            r = Request(ids=[1], params=SamplingParams(stop=stop), emit=lambda e: None)
            deltas, hit = [], None
            for i in range(0, len(ids), per_step):
                r.out_ids += ids[i : i + per_step]
                d, hit = Scheduler._detok(fake, r, final=i + per_step >= len(ids))
                deltas.append(d)
                if hit:
                    break
            want = text if stop is None else text[: text.index(stop)]
            assert not any("\ufffd" in d for d in deltas), (text, deltas)
            assert "".join(deltas) == want and r.text == want, (text, stop, deltas)
            assert (hit is None) == (stop is None)


# ---- 4. the context edge with speculation ----------------------------------------------------


def test_context_edge_with_speculation(selfspec, plain_greedy):
    for p in EDGE:
        want = plain_greedy[tuple(p)]
        n = CTX - len(p)
        assert len(want) == n
        st, r, _ = selfspec.request("POST", "/generate", {"input_ids": p, "sampling_params": greedy(1000)})
        assert st == 200, r
        m = r["meta_info"]
        assert (
            r["output_ids"] == want
            and m["completion_tokens"] == n
            and m["finish_reason"] == {"type": "length", "length": n}
        )
        assert m["speculative"] and m["spec_verify_ct"] == rounds(n)
        st, c, _ = selfspec.request(
            "POST", "/v1/completions", {"prompt": p, "temperature": 0}
        )  # max_tokens defaults to what fits
        assert st == 200 and c["choices"][0]["finish_reason"] == "length" and c["usage"]["completion_tokens"] == n
    st, r, _ = selfspec.request("POST", "/generate", {"input_ids": [5] * CTX, "sampling_params": greedy(1)})
    assert st == 400 and "context length" in r["error"]["message"]


# ---- 5. HTTP paths ---------------------------------------------------------------------------


def test_chunked_body_over_the_limit_is_413(selfspec):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    requests = selfspec.sched.stats.requests
    bodies = {
        "/v1/completions": {"prompt": "x" * 5000, "max_tokens": 1},
        "/generate": {"text": "x" * 5000},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 1},
    }
    for path, body in bodies.items():
        raw = json.dumps(body).encode()
        st, r, h = post(selfspec.port, path, headers=auth, chunks=[raw[i : i + 1000] for i in range(0, len(raw), 1000)])
        assert st == 413 and "limit" in r["error"]["message"] and r["error"]["type"] == "RequestTooLarge", (path, st, r)
    assert selfspec.sched.stats.requests == requests  # none of them reached the scheduler
    small = json.dumps({"input_ids": [5, 6], "sampling_params": greedy(2)}).encode()
    st, r, _ = post(selfspec.port, "/generate", headers=auth, chunks=[small[:10], small[10:]])
    assert st == 200 and r["meta_info"]["completion_tokens"] == 2  # a chunked body under the limit is fine


def flat_routes(routes):
    """Every route, those of included routers too (newer FastAPI keeps an included router as one
    entry of app.routes, holding the router it includes)."""
    for r in routes:
        inner = getattr(r, "original_router", None)
        if inner is not None:
            yield from flat_routes(inner.routes)
        else:
            yield r


@pytest.mark.slow
def test_every_route_but_health_needs_the_api_key(selfspec):
    app = selfspec.server.config.app
    routes = [
        (m, r.path)
        for r in flat_routes(app.routes)
        if getattr(r, "methods", None)
        for m in r.methods
        if m in ("GET", "POST")
    ]
    posts = {p for m, p in routes if m == "POST"}
    assert {"/v1/chat/completions", "/v1/completions", "/generate"} <= posts
    gets = {p for m, p in routes if m == "GET"} - {
        "/health",
        "/docs",
        "/redoc",
        "/openapi.json",
        "/docs/oauth2-redirect",
    }
    requests = selfspec.sched.stats.requests
    body = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/v1/completions": {"prompt": "hi", "max_tokens": 1},
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    }
    for auth in (None, "Bearer wrong", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, f"Basic {KEY}"):
        h = {"Content-Type": "application/json", **({"Authorization": auth} if auth is not None else {})}
        for path in sorted(posts):
            st, r, _ = post(selfspec.port, path, body.get(path, {}), headers=h)
            assert st == 401 and r["error"]["type"] == "AuthenticationError", (auth, path, st, r)
        for path in sorted(gets):
            st, r, _ = selfspec.request("GET", path, headers={"Authorization": auth or ""})
            assert st == 401, (auth, path, st, r)
    assert selfspec.sched.stats.requests == requests
    st, _, _ = post(selfspec.port, "/generate", body["/generate"], headers={"Authorization": f"Bearer {KEY}"})
    assert st == 200


def test_non_streaming_disconnect_cancels_the_request(scripted, dirs):
    sched = scripted.sched
    n = 2000  # several seconds of tokens
    aborted, finished = metric(scripted, "num_requests_aborted_total"), sched.stats.finished
    c = http.client.HTTPConnection("127.0.0.1", scripted.port, timeout=60)
    c.request(
        "POST",
        "/generate",
        body=json.dumps({"input_ids": dirs["chain"][:1], "sampling_params": greedy(n)}),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    wait_for(
        lambda: any(len(r.out_ids) > 5 for r in list(sched.busy.values())), 60, "the request did not start decoding"
    )
    req = next(iter(sched.busy.values()))
    try:
        c.sock.shutdown(socket.SHUT_RDWR)  # the client hangs up mid-request
        c.close()
        wait_for(
            lambda: req.cancelled or req.finished,
            3,
            lambda: f"still running 3 s after the client left ({len(req.out_ids)} tokens)",
        )
        assert req.cancelled and not req.finished and len(req.out_ids) < n
        wait_for(lambda: sched.running == 0, 10, "slot not freed")
        assert metric(scripted, "num_requests_aborted_total") == aborted + 1 and sched.stats.finished == finished
    finally:
        sched.cancel(req)  # whatever happened, do not leave it running for the next tests
        wait_for(lambda: sched.running == 0, 30, "slot not freed")
    st, r, _ = scripted.request("POST", "/generate", {"input_ids": dirs["chain"][:1], "sampling_params": greedy(3)})
    assert st == 200 and r["meta_info"]["completion_tokens"] == 3


def shutdown_mid_stream(dirs):
    """A fresh scripted server whose scheduler shuts down (as the app's lifespan does) while a
    stream runs: (server, the stream's lines, its parsed events)."""
    s = scripted_server(dirs)
    body = {"input_ids": dirs["chain"][:1], "sampling_params": greedy(1900), "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    c.request("POST", "/generate", body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    resp = c.getresponse()
    assert resp.status == 200
    first = resp.readline()
    while not first.startswith(b"data: "):
        first = resp.readline()
    stopper = threading.Thread(target=s.sched.shutdown)
    stopper.start()
    lines = [first.decode()] + [ln.decode() for ln in resp]
    stopper.join(30)
    return s, lines, [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]


def test_requests_during_shutdown_get_503(dirs):
    s, lines, data = shutdown_mid_stream(dirs)
    try:
        assert [ln.strip() for ln in lines if ln.strip()][-1] == "data: [DONE]"
        assert data[-1]["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(data[-1]["output_ids"]) < 1900
        ok = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        for path, b in (
            ("/generate", {"input_ids": [5], "sampling_params": greedy(2)}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ):
            st, r, _ = post(s.port, path, b, headers=ok)
            assert (
                st == 503 and r["error"]["type"] == "ServiceUnavailable" and "shutting down" in r["error"]["message"]
            ), (path, r)
        assert s.sched.stats.requests == 1 and s.sched.running == 0 and s.sched.queue_depth == 0
    finally:
        s.stop()


def test_requests_aborted_by_shutdown_are_counted(dirs):
    s, _, data = shutdown_mid_stream(dirs)
    try:
        assert data[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert metric(s, "num_requests_aborted_total") == 1
    finally:
        s.stop()


@pytest.mark.slow
def test_sigterm_mid_stream_with_speculation(dirs):
    """SIGTERM while a speculative stream is running: the stream completes ([DONE], every token),
    then the server exits without a traceback. The signal provably arrived mid-stream: the client
    had fewer tokens than the final count, and the server finished the request after the signal."""
    p, port = serve_subprocess(
        [
            "--model-path",
            dirs["target"],
            "--context-length",
            str(CTX),
            "--speculative-algorithm",
            "STANDALONE",
            "--speculative-draft-model-path",
            dirs["target"],
            "--speculative-draft-model-quantization",
            "unquant",
            "--speculative-num-steps",
            str(S),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(S + 1),
            "--num-continuous-decode-steps",
            str(K),
            "--disable-cuda-graph",
            "--shutdown-timeout",
            "300",
        ]
    )
    try:
        n = CTX - 2
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        t_send = time.perf_counter()
        c.request(
            "POST", "/generate", body=json.dumps({"input_ids": [3, 4], "stream": True, "sampling_params": greedy(n)})
        )
        r = c.getresponse()
        first = r.readline()
        while not first.startswith(b"data: {"):
            first = r.readline()
        seen = len(json.loads(first[6:])["output_ids"])  # tokens the client had when the signal went out
        t_sig = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        lines = [first.decode()] + [ln.decode() for ln in r]
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert [ln.strip() for ln in lines if ln.strip()][-1] == "data: [DONE]"
        m = data[-1]["meta_info"]
        assert m["finish_reason"]["type"] == "length" and len(data[-1]["output_ids"]) == n
        assert 0 < seen < n
        # perf_counter is CLOCK_MONOTONIC, one clock for both processes: the server received the request
        # after t_send, so it finished it after t_send + e2e_latency, i.e. after the signal
        assert t_send + m["e2e_latency"] > t_sig
        assert (
            m["speculative"]
            and m["spec_verify_ct"] == rounds(n)
            and m["spec_accept_histogram"] == [0] * S + [rounds(n)]
        )
        assert p.wait(60) in (0, -signal.SIGTERM)
        log = p.stdout.read()
        assert "Traceback" not in log and "shutting down" in log.lower(), log
    finally:
        if p.poll() is None:
            p.kill()

"""Property-based fuzzing of the HTTP API (hypothesis): a real uvicorn server over the tiny random
model of test_server.py (plain decoding, SmolLM2's tokenizer and chat template) gets generated
request bodies on /v1/chat/completions, /v1/completions and /generate, and raw junk on every route.

The bodies mix valid structure with junk: every field the OpenAI and SGLang APIs define (and
sampling_params.*), unknown fields, wrong types at every field, huge integers (2**64, 10**30,
-2**70, 4301-digit numbers), NaN / Infinity / 1e400, lone surrogates (the escape "\\ud800" and as
raw bytes), invalid UTF-8, deep nesting, empty and huge strings (on both sides of
--max-request-bytes), chunked uploads, non-JSON bytes and non-object JSON.

Checked for every request: no 5xx and no dropped connection; every non-2xx answer is a 400, 401,
404, 405 or 413 with an OpenAI-style error body {"object": "error", "error": {"message": str,
"type": str, ...}} (a trailing slash may redirect, 307); every 2xx answer has its route's shape
(streams: JSON events then [DONE], no error event), at most the tokens asked for and no stop
string in its text. After the fuzzing the same greedy requests give the same text as before it,
no request holds a slot, the scheduler recorded no failure and /health is 200.

Deterministic (derandomize=True). JAXSPEC_FUZZ_EXAMPLES (default 1000) is the number of bodies in
all: 30 % per POST route, 10 % raw. The last test prints a one-line count (requests, 2xx, 4xx,
5xx, connection errors, per status). A longer run:

    JAXSPEC_FUZZ_EXAMPLES=3000 JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q -s tests/test_server_fuzz.py
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import KEY, Server, model_dirs, start  # noqa: F401 - model_dirs is a fixture

TOTAL = int(os.environ.get("JAXSPEC_FUZZ_EXAMPLES", "1000"))
MAX_BYTES = 8192  # the server's --max-request-bytes
CONTEXT = 96  # and --context-length
VOCAB = 49152  # SmolLM2's tokenizer
INT32_MAX = 2**31 - 1
STATS: collections.Counter = collections.Counter()


def fuzz_settings(share: float):
    return settings(
        max_examples=max(1, int(TOTAL * share)),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


# ---- bodies --------------------------------------------------------------------------------------


class Raw(bytes):
    """Bytes spliced verbatim into a body: what json.dumps does not write (NaN, bad UTF-8, 4301 digits)."""

    def __repr__(self):
        return f"Raw({bytes(self[:60])!r}{'...' if len(self) > 60 else ''})"


def dumps(x, ascii_only: bool) -> bytes:
    """JSON text of x with Raw parts spliced in; ascii_only=False writes lone surrogates as raw bytes."""
    if isinstance(x, Raw):
        return bytes(x)
    if isinstance(x, dict):
        return b"{" + b",".join(dumps(k, ascii_only) + b":" + dumps(v, ascii_only) for k, v in x.items()) + b"}"
    if isinstance(x, list):
        return b"[" + b",".join(dumps(v, ascii_only) for v in x) + b"]"
    return json.dumps(x, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


RAW_TOKENS = [
    b"NaN",
    b"-NaN",
    b"Infinity",
    b"-Infinity",
    b"1e400",
    b"-1e400",
    b"1E-400",
    b"-0",
    b"1" * 4301,
    b"-" + b"9" * 4400,
    b"0." + b"0" * 400 + b"1",
    b'"\\ud800"',
    b'"a\\udfff"',
    b'"\\ud83d"',
    b'"\\udc00\\ud800"',
    b'"\xff\xfe"',
    b'"\xc3"',
    b'"\xed\xa0\x80"',
    b'"\xf4\x90\x80\x80"',
    b'"\\u0000"',
    b"\xef\xbb\xbf1",
    b"tru",
    b"nul",
    b"01",
    b"[1,]",
    b"{}",
    b"[]",
]
HUGE_INTS = [
    2**64,
    2**64 - 1,
    2**63,
    2**63 - 1,
    -(2**63),
    -(2**63) - 1,
    10**30,
    -(2**70),
    2**31,
    INT32_MAX,
    -1,
    0,
    10**300,
]
SPECIAL = [
    "",
    " ",
    "hi",
    "Once upon a time",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "\x00",
    "\u202e",
    "\ufeff",
    "\U0001f600",
    "null",
    "NaN",
    "Infinity",
    "1e400",
    "-1",
    "1",
    "0",
    "true",
    "{}",
    "[]",
]


def deep(depth: int, kind: str) -> Raw:
    return Raw(b"[" * depth + b"]" * depth if kind == "[" else b'{"a":' * depth + b"1" + b"}" * depth)


def one_in(k: int):
    """True one time in k (sampled_from draws uniformly; integers lean towards their bounds)."""
    return st.sampled_from(range(k)).map(lambda i: i == k - 1)


def weighted(*options):
    """One of the (weight, strategy) options, chosen in proportion to the weights."""
    flat = [s for w, s in options for _ in range(w)]
    return st.sampled_from(range(len(flat))).flatmap(lambda i: flat[i])


surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)
huge_str = st.builds(
    lambda c, n: c * n,
    st.sampled_from(["a", "hi ", "\u00e9", "\U0001f600", " ", "\n", "\x00", "<|im_end|>"]),
    st.integers(0, 3 * MAX_BYTES // 4) | st.sampled_from([MAX_BYTES - 64, MAX_BYTES, 2 * MAX_BYTES]),
)
short_text = st.text(max_size=16) | st.sampled_from(SPECIAL)
text = weighted((6, short_text), (1, surrogates.map(lambda s: "x" + s)), (1, huge_str))
scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HUGE_INTS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([5e-324, 1e308, -1e308, -0.0, 0.5, 1.5])
    | text
    | st.sampled_from(RAW_TOKENS).map(Raw)
    | surrogates.map(lambda s: Raw(json.dumps(s).encode()))
)
junk = st.recursive(
    scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(short_text, c, max_size=4), max_leaves=10
) | st.builds(deep, st.integers(1, 3000) | st.integers(980, 1000), st.sampled_from("[{"))


def field(valid, junk_share: int = 4):
    """A field value: usually from `valid`, one time in `junk_share` junk."""
    return one_in(junk_share).flatmap(lambda j: junk if j else valid)


def floats(lo, hi, exclude_min=False):
    """Floats in [lo, hi] (or (lo, hi]), their bounds and a few extreme ones."""
    extremes = [
        x
        for x in (lo, hi, 0, 1, -0.0, 5e-324, 1e-45, 1e-7, 2e-6, 1e30)
        if lo <= x <= hi and not (exclude_min and x == lo)
    ]
    return st.floats(lo, hi, exclude_min=exclude_min) | st.sampled_from(extremes)


tokens = st.integers(0, VOCAB - 1)
max_tok = weighted((9, st.integers(0, 3)), (1, st.integers(4, 16)))  # few tokens: the accepted requests stay cheap
stop_words = st.sampled_from([" ", "e", "a", "\n", ".", "the", "<|im_end|>", "<|endoftext|>", ""])
seeds = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, -1, 2**64 - 1, -(2**63)])
clean_prompt = st.text(max_size=16) | st.sampled_from(SPECIAL[1:])

# valid values of SamplingParams' fields (SGLang's sampling_params) and of its aliases
SAMPLING_OK = {
    "max_new_tokens": max_tok,
    "max_tokens": max_tok,
    "temperature": floats(0, 2) | st.just(1e30),
    "top_p": floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 100).filter(bool) | st.just(INT32_MAX),
    "min_p": floats(0, 1),
    "frequency_penalty": floats(-2, 2),
    "presence_penalty": floats(-2, 2),
    "repetition_penalty": floats(0, 2, exclude_min=True),
    "stop": st.none() | stop_words | short_text | st.lists(stop_words | short_text, max_size=4),
    "stop_token_ids": st.lists(tokens, max_size=4),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "seed": seeds,
    "sampling_seed": seeds,
    "n": st.sampled_from([1, None, 2]),
}
# ... and with out-of-range values and what SGLang has beyond it
SAMPLING = {
    **SAMPLING_OK,
    "top_k": SAMPLING_OK["top_k"] | st.just(0),
    "top_p": floats(0, 1),
    "repetition_penalty": floats(0, 2),
    "temperature": floats(-1, 1e30),
    "stop": SAMPLING_OK["stop"] | st.lists(st.just("a"), min_size=33, max_size=40) | st.just(["x" * 1025]),
    "stop_token_ids": SAMPLING_OK["stop_token_ids"]
    | st.lists(st.integers(0, INT32_MAX), max_size=3)
    | st.lists(tokens, min_size=60, max_size=70),
    "n": st.sampled_from([1, 2, 0, None]),
    "json_schema": st.sampled_from([None, "{}", '{"type": "object"}']),
    "regex": st.sampled_from([None, "a+"]),
    "ebnf": st.sampled_from([None, "root ::= 'a'"]),
    "structural_tag": st.sampled_from([None, "{}"]),
    "min_new_tokens": max_tok,
    "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "custom_params": st.none() | st.dictionaries(short_text, short_text, max_size=2),
    "stream_interval": st.integers(1, 4),
    "logit_bias": st.sampled_from([None, {}, {"1": 1.0}]),
}
COMMON_OK = {
    **{
        k: SAMPLING_OK[k]
        for k in (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "ignore_eos",
            "skip_special_tokens",
        )
    },
    "model": st.sampled_from(["default", "", "target"]),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logit_bias": st.sampled_from([None, {}]),
    "speculative": st.booleans(),
    "user": short_text,
    "metadata": st.none() | st.dictionaries(short_text, short_text, max_size=3),
    "store": st.booleans(),
    "service_tier": st.sampled_from(["auto", "default", None]),
    "parallel_tool_calls": st.booleans(),
}
COMMON = {
    **COMMON_OK,
    **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "repetition_penalty")},
    "model": st.sampled_from(["default", "", "target", "gpt-4o", "Default", None]) | short_text,
    "seed": seeds | st.sampled_from(HUGE_INTS),
    "n": st.sampled_from([1, 2, 0, None]),
    "logit_bias": st.sampled_from([None, {}, {"1": 5.0}, {"50256": -100}, {"x": 1}]),
}
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image_url", "input_audio", "refusal"]), "text": text},
    optional={"image_url": st.just({"url": "data:,"})},
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "system", "assistant", "developer", "tool", "function", "bogus"]),
        "content": weighted((4, text), (1, st.none()), (2, st.lists(field(part, 8), max_size=3))),
    },
    optional={
        "name": short_text,
        "tool_calls": st.sampled_from([[], [{"id": "1", "type": "function"}]]),
        "tool_call_id": short_text,
    },
)
message_ok = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "system", "assistant", "developer"]),
        "content": clean_prompt
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": clean_prompt}), min_size=1, max_size=3),
    },
    optional={"name": short_text},
)
tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_OK = {
    **COMMON_OK,
    "messages": st.lists(message_ok, min_size=1, max_size=3),
    "max_completion_tokens": max_tok,
    "logprobs": st.sampled_from([False, None, True]),
    "top_logprobs": st.sampled_from([0, None]),
    "response_format": st.sampled_from([None, {}, {"type": "text"}]),
    "tools": st.sampled_from([None, []]),
    "tool_choice": st.sampled_from([None, "none", "auto"]),
    "modalities": st.sampled_from([None, ["text"]]),
}
CHAT = {
    **COMMON,
    **CHAT_OK,
    "messages": weighted((7, st.lists(field(message, 8), min_size=1, max_size=3)), (1, st.just([]))),
    "logprobs": st.booleans() | st.none(),
    "top_logprobs": st.integers(0, 21) | st.none(),
    "response_format": st.sampled_from(
        [
            None,
            {},
            {"type": "text"},
            {"type": "json_object"},
            {"type": None},
            {"type": ["text"]},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        ]
    ),
    "tools": st.sampled_from([None, [], [tool]]),
    "tool_choice": st.sampled_from([None, "none", "auto", "required", {"type": "function"}]),
    "functions": st.sampled_from([None, [], [tool["function"]]]),
    "function_call": st.sampled_from([None, "none", "auto", {"name": "f"}]),
    "audio": st.sampled_from([None, {"voice": "alloy", "format": "wav"}]),
    "modalities": st.sampled_from([None, [], ["text"], ["text", "audio"]]),
    "prediction": st.sampled_from([None, {"type": "content", "content": "x"}]),
    "reasoning_effort": st.sampled_from([None, "low", "high"]),
    "web_search_options": st.sampled_from([None, {}]),
}
COMPLETION_OK = {
    **COMMON_OK,
    "prompt": clean_prompt
    | st.lists(tokens, min_size=1, max_size=8)
    | st.lists(clean_prompt, min_size=1, max_size=1)
    | st.lists(st.lists(tokens, min_size=1, max_size=5), min_size=1, max_size=1),
    "echo": st.booleans(),
    "suffix": st.sampled_from([None, ""]),
    "logprobs": st.none() | st.integers(0, 5),
    "best_of": st.sampled_from([None, 1]),
}
COMPLETION = {
    **COMMON,
    "prompt": text
    | st.lists(tokens, max_size=8)
    | st.lists(short_text, max_size=2)
    | st.lists(st.lists(tokens, max_size=5), max_size=2)
    | st.lists(st.integers(-2, INT32_MAX), max_size=3),
    "echo": st.booleans(),
    "suffix": st.none() | short_text,
    "logprobs": st.none() | st.integers(0, 6),
    "best_of": st.sampled_from([None, 1, 2]),
}
SGLANG_EXTRA = {  # SGLang's /generate fields this server ignores
    "return_text_in_logprobs": st.booleans(),
    "image_data": st.sampled_from([None, "data:,"]),
    "lora_path": st.none(),
    "modalities": st.sampled_from([None, ["image"]]),
    "session_params": st.none(),
    "custom_logit_processor": st.none(),
    "return_hidden_states": st.booleans(),
    "log_metrics": st.booleans(),
    "bootstrap_host": st.none(),
    "data_parallel_rank": st.none() | st.integers(0, 2),
}
GENERATE_OK = {
    **SGLANG_EXTRA,
    "text": clean_prompt,
    "sampling_params": st.deferred(lambda: sampling_dict(True)),
    "input_ids": weighted(
        (7, st.lists(tokens, min_size=1, max_size=8)), (1, st.lists(tokens, min_size=60, max_size=100))
    ),
    "stream": st.booleans(),
    "speculative": st.booleans(),
    "rid": short_text,
    "return_logprob": st.booleans(),
    "top_logprobs_num": st.integers(0, 20),
    "logprob_start_len": st.integers(-1, 100),
}
GENERATE = {
    **GENERATE_OK,
    "text": text,
    "input_ids": st.lists(tokens, max_size=8) | st.lists(st.integers(-1, INT32_MAX), max_size=3),
    "sampling_params": st.deferred(lambda: sampling_dict(False)),
    "return_logprob": st.booleans(),
    "top_logprobs_num": st.integers(0, 21),
    "logprob_start_len": st.integers(-2, 100),
}
ALIASES = {"max_tokens": "max_new_tokens", "sampling_seed": "seed"}
UNKNOWN = (
    st.sampled_from(
        ["bogus", "", "__class__", "model_config", "ALIASES", "max_new_tokens", "sampling_params", "messages "]
    )
    | short_text
)
# route: (fields with junk, fields with valid values, the alternative required fields, the field that caps the tokens)
ROUTES = {
    "/v1/chat/completions": (CHAT, CHAT_OK, [("messages",)], "max_tokens"),
    "/v1/completions": (COMPLETION, COMPLETION_OK, [("prompt",)], "max_tokens"),
    "/generate": (GENERATE, GENERATE_OK, [("text",), ("input_ids",)], "sampling_params"),
}


@st.composite
def sampling_dict(draw, clean: bool):
    if clean:
        d = {
            k: draw(SAMPLING_OK[k])
            for k in draw(st.permutations(sorted(set(SAMPLING_OK) - set(ALIASES))))
            if draw(one_in(2))
        }
        for alias, name in ALIASES.items():
            if name in d and draw(one_in(4)):
                d[alias] = d.pop(name)
    else:
        names = draw(st.lists(st.sampled_from(sorted(SAMPLING)), unique=True, max_size=5))
        if draw(one_in(8)):
            names.append(draw(UNKNOWN))
        d = {k: draw(field(SAMPLING.get(k, junk))) for k in names}
    if all(d.get(k) is None for k in ("max_new_tokens", "max_tokens")):
        d["max_new_tokens"] = draw(max_tok)  # keep the accepted requests cheap (the default is the context length)
    return d


@st.composite
def bodies(draw, route: str):
    """A request body. One time in three only valid values of known fields (most are accepted); else the
    required fields (usually), a few known and unknown fields, each valid or junk."""
    fields, fields_ok, required, cap = ROUTES[route]
    if draw(one_in(3)):
        d = {k: draw(fields_ok[k]) for k in draw(st.sampled_from(required))}
        for k in draw(st.permutations(sorted(set(fields_ok) - {"text", "input_ids", "messages", "prompt"}))):
            if draw(one_in(2)):
                d[k] = draw(fields_ok[k])
    else:
        d = {k: draw(field(fields[k], 6)) for k in draw(st.sampled_from(required)) if not draw(one_in(12))}
        for k in draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=6)):
            d[k] = draw(field(fields[k]))
        for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
            d[draw(UNKNOWN | st.sampled_from(sorted(SAMPLING)))] = draw(junk)
        if draw(one_in(16)):
            d[Raw(draw(st.sampled_from([b'"\\ud800"', b'"\xff"', b'"model"', b'"a\\udc00b"'])))] = draw(short_text)
    # keep the accepted requests cheap (the default is the rest of the context; the last test checks it)
    if cap == "sampling_params" and d.get(cap) is None:
        d[cap] = draw(sampling_dict(True))
    elif (
        cap == "sampling_params"
        and isinstance(d[cap], dict)
        and all(d[cap].get(k) is None for k in ("max_new_tokens", "max_tokens"))
    ):
        d[cap]["max_new_tokens"] = draw(max_tok)
    elif cap != "sampling_params" and d.get("max_tokens") is None:
        d[cap] = draw(max_tok)
    return d


@st.composite
def route_case(draw, route: str):
    """((raw bytes, Content-Type, chunked upload), the body)."""
    body = draw(bodies(route))
    data = dumps(body, ascii_only=draw(st.booleans()))
    if draw(one_in(20)):  # a damaged body
        cut = draw(st.integers(1, max(len(data), 1)))
        data = draw(
            st.sampled_from(
                [data[:cut], data[:cut] + b"\xff" + data[cut:], data + b"}", data + b" x", b"\xef\xbb\xbf" + data]
            )
        )
    ctype = draw(
        st.sampled_from(
            ["application/json"] * 6
            + [None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"]
        )
    )
    return (data, ctype, draw(one_in(8))), body


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b" ",
            b"null",
            b"0",
            b"[]",
            b'""',
            b"true",
            b"[{}]",
            b"{",
            b"}",
            b"{}}",
            b"{'a': 1}",
            b'{"a"}',
            b'{"a":}',
            b"\xff\xfe{\x00}\x00",
            b"\x00" * 16,
            b"NaN",
            b"{}" * 3,
        ]
    ),
    st.builds(lambda x, a: dumps(x, a), junk, st.booleans()),
    st.sampled_from(RAW_TOKENS).map(bytes),
    st.builds(lambda d, k: bytes(deep(d, k)), st.integers(1, 5000), st.sampled_from("[{")),
    st.binary(min_size=MAX_BYTES - 2, max_size=MAX_BYTES + 2),
)


# ---- the server and its checks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(model_dirs):  # noqa: F811 - pytest fixture imported from helpers
    s = start(
        model_dirs,
        speculative_algorithm="NONE",
        max_running_requests=1,
        cuda_graph_max_bs=1,
        context_length=CONTEXT,
        max_request_bytes=MAX_BYTES,
    )
    s.reference = greedy_reference(s)  # before any fuzzing
    s.t0 = time.perf_counter()
    yield s
    s.stop()


def greedy_reference(s: Server) -> list:
    chat = {
        "messages": [{"role": "user", "content": "Name three colours."}],
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
    }
    gen = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    a = s.request("POST", "/v1/chat/completions", chat)
    b = s.request("POST", "/generate", gen)
    assert a[0] == 200 and b[0] == 200, (a, b)
    return [a[1]["choices"][0]["message"]["content"], b[1]["output_ids"], b[1]["text"]]


def send(
    s: Server,
    method: str,
    path: str,
    data: bytes | None,
    ctype: str | None = "application/json",
    chunked: bool = False,
    auth: bool = True,
):
    """(status, headers, body bytes); a dropped connection or a timeout fails the test."""
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
    h = {"Authorization": f"Bearer {KEY}"} if auth else {}
    if ctype:
        h["Content-Type"] = ctype
    STATS["requests"] += 1
    try:
        body = (
            iter([data[i : i + 1500] for i in range(0, len(data), 1500)] or [b""])
            if chunked and data is not None
            else data
        )
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    except (OSError, http.client.HTTPException) as e:
        STATS["connection errors"] += 1
        raise AssertionError(f"{method} {path}: {type(e).__name__}: {e} (body {data[:200]!r})") from None
    finally:
        c.close()
    STATS[f"{out[0] // 100}xx"] += 1
    STATS[out[0]] += 1
    return out


def check_error(status: int, headers: dict, raw: bytes, what: str) -> None:
    assert status in (400, 401, 404, 405, 413), f"{what}: status {status}: {raw[:500]!r}"
    assert headers.get("content-type", "").startswith("application/json"), f"{what}: {headers}"
    e = json.loads(raw)
    assert isinstance(e, dict) and e.get("object") == "error" and isinstance(e.get("error"), dict), f"{what}: {e}"
    assert isinstance(e["error"].get("message"), str) and e["error"]["message"], f"{what}: {e}"
    assert isinstance(e["error"].get("type"), str) and e["error"]["type"], f"{what}: {e}"
    assert "Traceback" not in e["error"]["message"], f"{what}: {e}"


def sse_events(raw: bytes, what: str) -> list:
    lines = [ln for ln in raw.decode().split("\n") if ln.strip()]
    assert lines and lines[-1] == "data: [DONE]", f"{what}: {raw[-300:]!r}"
    events = []
    for ln in lines[:-1]:
        assert ln.startswith("data: "), f"{what}: {ln!r}"
        e = json.loads(ln[6:])
        assert "error" not in e, f"{what}: error event {e}"
        events.append(e)
    assert events, what
    return events


def cap_of(body) -> int | None:
    """The most tokens the body asks for, when it says so with a plain integer."""
    if not isinstance(body, dict):
        return None
    for k in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
        v = body.get(k)
        if type(v) is int:
            return v
    return None


def stops_of(body) -> list[str]:
    s = body.get("stop") if isinstance(body, dict) else None
    return [x for x in ([s] if isinstance(s, str) else s if isinstance(s, list) else []) if isinstance(x, str) and x]


def check_output(text: str, n_tokens: int, reason: str, matched, body, what: str) -> None:
    """At most the tokens asked for; cut before the first stop string, which a "stop" finish names."""
    cap = cap_of(body)
    assert cap is None or n_tokens <= cap, f"{what}: asked for {cap} tokens, got {n_tokens}"
    assert reason in ("stop", "length", "tool_calls"), f"{what}: finish reason {reason!r}"
    stops = stops_of(body)
    assert not any(x in text for x in stops), f"{what}: the output {text!r} holds a stop string of {stops}"
    assert not isinstance(matched, str) or matched in stops, f"{what}: matched {matched!r}, not one of {stops}"


def check_tool_calls(calls, what: str) -> None:
    assert isinstance(calls, list) and calls, f"{what}: {calls}"
    for t in calls:
        assert t["type"] == "function" and isinstance(t["id"], str), f"{what}: {calls}"
        assert isinstance(t["function"]["name"], str) and isinstance(t["function"]["arguments"], str), (
            f"{what}: {calls}"
        )


def check_openai(raw: bytes, headers: dict, body: dict, chat: bool, what: str) -> None:
    """Every choice (n, batched prompts) checked on its own; an echoed prompt may hold a stop string."""
    obj = "chat.completion" if chat else "text_completion"
    echo = not chat and body.get("echo") is True
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(raw, what)
        texts: dict = collections.defaultdict(str)
        fin: dict = collections.defaultdict(list)
        for e in events:
            assert e["object"] == (obj + ".chunk" if chat else obj), f"{what}: {e}"
            for c in e["choices"]:
                piece = c["delta"].get("content", "") if chat else c["text"]
                assert isinstance(piece, str), f"{what}: {e}"
                if chat and "tool_calls" in c["delta"]:
                    check_tool_calls(c["delta"]["tool_calls"], what)
                texts[c["index"]] += piece
                fin[c["index"]] += [c] if c["finish_reason"] is not None else []
        assert texts and all(len(f) == 1 for f in fin.values()) and set(fin) == set(texts), f"{what}: {events[-3:]}"
        for i, text in texts.items():
            f = fin[i][0]
            check_output("" if echo else text, 0, f["finish_reason"], f.get("matched_stop"), body, what)
        return
    assert headers.get("content-type", "").startswith("application/json"), f"{what}: {headers}"
    r = json.loads(raw)
    assert r["object"] == obj and r["choices"], f"{what}: {r}"
    assert [c["index"] for c in r["choices"]] == list(range(len(r["choices"]))), f"{what}: {r}"
    u = r["usage"]
    assert all(type(u[k]) is int and u[k] >= 0 for k in ("prompt_tokens", "completion_tokens", "total_tokens")), (
        f"{what}: {r}"
    )
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0, f"{what}: {r}"
    cap = cap_of(body)
    assert cap is None or u["completion_tokens"] <= cap * len(r["choices"]), f"{what}: {r}"
    for c in r["choices"]:
        out = c["message"]["content"] if chat else c["text"]
        if chat and c["finish_reason"] == "tool_calls":  # a tool call: content is None or the text before it
            check_tool_calls(c["message"]["tool_calls"], what)
            out = out or ""
        assert isinstance(out, str), f"{what}: {r}"
        if chat:
            assert c["message"]["role"] == "assistant", f"{what}: {r}"
        check_output("" if echo else out, 0, c["finish_reason"], c.get("matched_stop"), body, f"{what}: {r}")


def check_generate(raw: bytes, headers: dict, body: dict, what: str) -> None:
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(raw, what)
        last: dict = {}
        for e in events:  # per sample (n > 1: each event has its index)
            i = e.get("index", 0)
            if i in last and e["meta_info"].get("finish_reason") is not None:
                assert last[i]["text"] == e["text"], f"{what}: streamed {last[i]['text']!r}, final {e['text']!r}"
            last[i] = e
        results = list(last.values())
    else:
        r = json.loads(raw)
        results = r if isinstance(r, list) else [r]
    for r in results:
        assert isinstance(r["text"], str) and all(type(t) is int and 0 <= t < VOCAB for t in r["output_ids"]), (
            f"{what}: {r}"
        )
        m = r["meta_info"]
        assert m["completion_tokens"] == len(r["output_ids"]), f"{what}: {r}"
        sp = body.get("sampling_params")
        check_output(
            r["text"],
            len(r["output_ids"]),
            m["finish_reason"]["type"],
            m["finish_reason"].get("matched"),
            sp,
            f"{what}: {r}",
        )


def post(s: Server, path: str, case, body) -> None:
    data, ctype, chunked = case
    what = f"POST {path} {data[:400]!r}{'...' if len(data) > 400 else ''} (Content-Type {ctype}, chunked {chunked})"
    status, headers, raw = send(s, "POST", path, data, ctype, chunked)
    if status // 100 != 2:
        return check_error(status, headers, raw, what)
    assert status == 200, what
    if path == "/generate":
        check_generate(raw, headers, body, what)
    else:
        check_openai(raw, headers, body, path == "/v1/chat/completions", what)


# ---- the tests -----------------------------------------------------------------------------------


@fuzz_settings(0.3)
@given(case=route_case("/v1/chat/completions"))
def test_fuzz_chat_completions(srv, case):
    STATS["chat"] += 1
    post(srv, "/v1/chat/completions", *case)


@fuzz_settings(0.3)
@given(case=route_case("/v1/completions"))
def test_fuzz_completions(srv, case):
    STATS["completions"] += 1
    post(srv, "/v1/completions", *case)


@fuzz_settings(0.3)
@given(case=route_case("/generate"))
def test_fuzz_generate(srv, case):
    STATS["generate"] += 1
    post(srv, "/generate", *case)


@fuzz_settings(0.1)
@given(
    data=raw_bodies,
    path=st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/generate",
            "/v1/models",
            "/health",
            "/nope",
            "/generate/",
            "//generate",
            "/generate?x=%ff",
            "/GENERATE",
        ]
    ),
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]),
    chunked=st.booleans(),
    auth=one_in(16).map(lambda x: not x),
)
def test_fuzz_raw_bodies(srv, data, path, method, chunked, auth):
    """Non-JSON bytes, non-object JSON, oversized bodies, wrong methods and paths, no API key."""
    STATS["raw"] += 1
    what = f"{method} {path} {data[:300]!r} (chunked {chunked}, auth {auth})"
    status, headers, raw = send(srv, method, path, data, chunked=chunked, auth=auth)
    if status // 100 == 2:
        assert method == "GET" and path in ("/v1/models", "/health"), what
    elif status == 307:  # a trailing slash: redirected to the route
        assert path.endswith("/") and headers["location"].endswith(path.rstrip("/")), what
    else:
        check_error(status, headers, raw, what)


def test_server_still_serves_after_fuzzing(srv, capsys):
    codes = ", ".join(f"{k}: {STATS[k]}" for k in sorted(k for k in STATS if isinstance(k, int)))
    with capsys.disabled():
        print(
            f"\nserver fuzz: {STATS['requests']} requests ({STATS['chat']} chat, {STATS['completions']} completions, "
            f"{STATS['generate']} generate, {STATS['raw']} raw) in {time.perf_counter() - srv.t0:.1f} s: {STATS['2xx']} 2xx, "
            f"{STATS['4xx']} 4xx, {STATS['5xx']} 5xx, {STATS['connection errors']} connection errors ({codes})"
        )
    status, headers, raw = send(srv, "GET", "/health", None, None)
    assert status == 200 and raw.startswith(b"ok"), raw
    assert greedy_reference(srv) == srv.reference
    # what the fuzzing leaves out to stay cheap: no max_tokens is the rest of the context
    status, r, _ = srv.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True})
    assert status == 200 and r["usage"]["completion_tokens"] == CONTEXT - 3, r
    t = time.time()
    while srv.sched.running or srv.sched.queue_depth:  # nothing left holding a slot
        assert time.time() - t < 30, (srv.sched.running, srv.sched.queue_depth)
        time.sleep(0.05)
    assert srv.sched.error is None and srv.sched.stats.failed == 0 and srv.sched.stats.recoveries == 0

"""Constrained decoding (jaxspec/grammar.py) and tool calls (server/tools.py), speculation on and off.

Tiny random models with SmolLM2's tokenizer: a random model's free output is noise, so whatever
it emits under a schema, regex or grammar shows that the masks hold. Checked: outputs validate
(jsonschema, re.fullmatch), greedy outputs with speculation equal constrained plain decoding, the
sampled constrained distribution equals the exact one (computed from the HF model and the
grammar's own masks, with a power check), invalid grammars are 400s with the library's message,
response_format / tools / tool_choice over HTTP (streamed too), and real clients with pydantic
models: the openai SDK's `chat.completions.parse` and `stream` helpers, and instructor.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from helpers import KEY, chi2_pvalue, model_dirs, save_eagle_head, start  # noqa: F401 - model_dirs is a fixture

PERSON = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "n", "tag"],
    "additionalProperties": False,
}
REGEX = r"(red|green|blue)-[0-9]{2,4}"
EBNF = 'root ::= "The answer is " ("A" | "B" | "C") "."'
PROMPTS = ["Answer in JSON.", "What colour is the sky?", "Pick one.", "Say something."]
SPEC = dict(
    speculative_algorithm="STANDALONE",
    speculative_num_steps=3,
    speculative_eagle_topk=2,
    speculative_num_draft_tokens=6,
)


@pytest.fixture(scope="module")
def engines(model_dirs):  # noqa: F811
    import jaxspec

    common = dict(show_progress=False, context_length=256, max_running_requests=4)
    plain = jaxspec.Engine(model_dirs["target"], speculative_algorithm="NONE", **common)
    spec = jaxspec.Engine(model_dirs["target"], speculative_draft_model_path=model_dirs["draft"], **SPEC, **common)
    return plain, spec


@pytest.fixture(scope="module")
def eagle3(model_dirs, tmp_path_factory):  # noqa: F811
    """An EAGLE-3 head with a 4,096-token draft vocabulary: draft masks go through its token map."""
    import jaxspec

    with open(f"{model_dirs['target']}/config.json") as f:
        cfg = json.load(f)
    head = save_eagle_head(
        tmp_path_factory.mktemp("eagle3"), "EAGLE3", cfg, seed=1, draft_vocab=4096, scale=4.0, aux_layer_ids=[-1, 0, 1]
    )
    spec = {**SPEC, "speculative_algorithm": "EAGLE3"}
    return jaxspec.Engine(
        model_dirs["target"],
        speculative_draft_model_path=head,
        show_progress=False,
        context_length=256,
        max_running_requests=4,
        **spec,
    )


def _check(kind, text):
    import jsonschema

    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"The answer is [ABC]\.", text), text


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("json_schema", json.dumps(PERSON)),
        pytest.param("regex", REGEX, marks=pytest.mark.slow),
        pytest.param("ebnf", EBNF, marks=pytest.mark.slow),
    ],
)
def test_greedy_constrained_speculation_identical_and_valid(engines, eagle3, kind, spec):
    plain, specd = engines
    params = {"temperature": 0, "max_new_tokens": 64, kind: spec}
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    a = plain.chat(msgs, params)
    b = specd.chat(msgs, params)
    c = eagle3.chat(msgs, params)
    for x, y, z in zip(a, b, c):
        assert x["meta_info"]["finish_reason"]["type"] == "stop", x
        _check(kind, x["text"])
        assert x["output_ids"] == y["output_ids"] == z["output_ids"]
    # a batch mixing constrained and free requests: the free ones are untouched by the masks
    free = {"temperature": 0, "max_new_tokens": 16}
    mixed = specd.chat(msgs[:2], [params, free])
    assert mixed[0]["output_ids"] == b[0]["output_ids"]
    assert mixed[1]["output_ids"] == plain.chat(msgs[1], free)["output_ids"]


def test_invalid_grammars_are_clear_errors(engines):
    from jaxspec.errors import JaxspecError

    plain, _ = engines
    for params, match in [
        ({"regex": "a(b"}, "(?s)invalid regex.*unclosed group"),
        ({"json_schema": '{"type": "foo"}'}, "invalid json_schema"),
        ({"json_schema": "{not json"}, "not JSON"),
        ({"ebnf": "root ::= ("}, "invalid ebnf"),
        ({"regex": "a", "ebnf": EBNF}, "at most one"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"regex": "a" * 100_001}, "at most 100000 characters"),
    ]:
        with pytest.raises(JaxspecError, match=match):
            plain.generate("hi", {"max_new_tokens": 4, **params})


def _exact_distribution(model_dir, prompt_ids, grammar_text):
    """P(output token sequence) of constrained sampling at temperature 1: the HF model's
    distribution at each prefix, restricted to the tokens the grammar's matcher allows there and
    renormalised, multiplied along every path the grammar allows (to EOS)."""
    import llguidance
    import llguidance.hf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    v = hf.config.vocab_size
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=v, eos_token=[tok.eos_token_id])
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_regex(grammar_text), log_level=0)
    out: dict[tuple, float] = {}

    def walk(path, prob):
        bits = np.frombuffer(m.compute_bitmask(), np.uint32)
        ok = np.array([(bits[t // 32] >> (t % 32)) & 1 for t in range(v)], bool)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + list(path)])).logits[0, -1].numpy().astype(np.float64)
        p = np.where(ok, np.exp(logits - logits[ok].max()), 0.0)
        p /= p.sum()
        for t in np.nonzero(p)[0]:
            if t == tok.eos_token_id:
                out[path] = out.get(path, 0.0) + prob * p[t]
                continue
            assert m.consume_token(int(t))
            walk(path + (int(t),), prob * p[t])
            m.rollback(1)

    walk((), 1.0)
    return out


@pytest.mark.slow
def test_sampled_constrained_distribution_is_exact(engines, model_dirs):  # noqa: F811
    """Constrained sampling with speculation draws from the constrained target distribution:
    chi-square against the exact probabilities of every allowed output, with a power check (a
    sampler that ignores the first mask position's renormalisation would be caught)."""
    from scipy.stats import chi2 as chi2_dist

    plain, specd = engines
    regex = "(ab|c|d)(e|f)"
    prompt = plain.encode(plain.apply_chat_template([{"role": "user", "content": "Pick."}]), add_special_tokens=False)
    exact = _exact_distribution(model_dirs["target"], prompt, regex)
    outs = sorted(exact)
    probs = np.array([exact[o] for o in outs])
    assert abs(probs.sum() - 1) < 1e-6 and len(outs) >= 4
    n = 1200
    for eng in (specd, plain):
        res = eng.generate(
            input_ids=[prompt] * n,
            sampling_params=[{"temperature": 1, "regex": regex, "seed": s, "max_new_tokens": 8} for s in range(n)],
        )
        got = [tuple(r["output_ids"][:-1]) for r in res]  # without the EOS
        assert all(r["meta_info"]["finish_reason"]["type"] == "stop" for r in res)
        assert set(got) <= set(outs)
        counts = np.array([got.count(o) for o in outs])
        assert chi2_pvalue(counts, probs) > 1e-3, (counts, probs * n)
    # power: the same counts against a distribution that differs as much as a wrong
    # renormalisation would (the uniform one over the allowed outputs) are rejected
    stat = ((counts - n / len(outs)) ** 2 / (n / len(outs))).sum()
    assert chi2_dist.sf(stat, len(outs) - 1) < 1e-3 or np.allclose(probs, 1 / len(outs), atol=0.05)


@pytest.fixture(scope="module")
def server(model_dirs):  # noqa: F811
    s = start(
        model_dirs,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=model_dirs["draft"],
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        max_running_requests=4,
        disable_cuda_graph=True,  # compile on first use: only the shapes these tests meet
        context_length=640,  # tool descriptions make long prompts
    )
    yield s
    s.stop()


def _chat(server, **body):
    body = {"messages": [{"role": "user", "content": "Give me a record."}], "temperature": 0, "max_tokens": 64, **body}
    return server.request("POST", "/v1/chat/completions", body)


def test_response_format_and_extensions_over_http(server, engines):
    import jsonschema

    plain, _ = engines
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    status, out, _ = _chat(server, response_format=fmt)
    assert status == 200, out
    text = out["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), PERSON)
    # speculative server == constrained plain decoding offline
    ref = plain.chat(
        [{"role": "user", "content": "Give me a record."}],
        {"temperature": 0, "max_new_tokens": 64, "json_schema": PERSON},
    )
    assert text == ref["text"]
    status, out, _ = _chat(server, response_format={"type": "json_object"}, max_tokens=48)
    assert status == 200 and out["choices"][0]["message"]["content"].startswith("{")
    status, out, _ = _chat(server, regex=REGEX)
    assert re.fullmatch(REGEX, out["choices"][0]["message"]["content"])
    status, out, _ = server.request(
        "POST", "/v1/completions", {"prompt": "The answer", "ebnf": EBNF, "temperature": 0, "max_tokens": 32}
    )
    assert status == 200 and re.fullmatch(r"The answer is [ABC]\.", out["choices"][0]["text"])
    status, out, _ = server.request(
        "POST",
        "/generate",
        {"text": "x", "sampling_params": {"regex": REGEX, "temperature": 1, "max_new_tokens": 32, "seed": 3}},
    )
    assert status == 200 and re.fullmatch(REGEX, out["text"])
    events = server.stream(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "regex": REGEX, "temperature": 0, "max_tokens": 32},
    )
    assert re.fullmatch(REGEX, "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]))


@pytest.mark.parametrize(
    "body,match",
    [
        ({"regex": "a(b"}, "unclosed group"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "invalid json_schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "pass one"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "no tool named",
        ),
    ],
)
def test_bad_constraints_are_400(server, body, match):
    status, out, _ = _chat(server, **body)
    assert status == 400, out
    assert re.search(match, out["error"]["message"]), out


def test_a_refused_token_fails_the_request_loudly(server, monkeypatch):
    """Should a matcher ever refuse an emitted token (a bug), the request fails with a 500 and a
    logged reason, counted in /metrics, rather than return output that breaks its grammar."""
    from jaxspec import grammar

    monkeypatch.setattr(grammar, "rejection", lambda h: "the grammar matcher rejected an emitted token: (test)")
    status, out, _ = _chat(server, regex=REGEX)
    assert status == 500 and "rejected an emitted token" in out["error"]["message"], out
    assert server.sched.stats.grammar_rejections == 1
    status, text, _ = server.request("GET", "/metrics")
    assert re.search(r"num_grammar_rejections_total\{[^}]*\} 1", text), text
    monkeypatch.undo()
    status, out, _ = _chat(server, regex=REGEX)  # the server goes on
    assert status == 200 and re.fullmatch(REGEX, out["choices"][0]["message"]["content"])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def test_tool_calls(server):
    import jsonschema

    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    status, out, _ = _chat(server, messages=msgs, tools=[WEATHER, TIME], tool_choice=named)
    assert status == 200, out
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    status, out, _ = _chat(server, messages=msgs, tools=[WEATHER, TIME], tool_choice="required")
    calls = out["choices"][0]["message"]["tool_calls"]  # one or more (parallel_tool_calls defaults to true)
    assert calls and all(c["function"]["name"] in ("get_weather", "get_time") for c in calls), out
    for c in calls:
        schema = WEATHER if c["function"]["name"] == "get_weather" else TIME
        jsonschema.validate(json.loads(c["function"]["arguments"]), schema["function"]["parameters"])
    status, out, _ = _chat(
        server, messages=msgs, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time")
    # streamed: one delta carries the whole call
    events = server.stream(
        "/v1/chat/completions",
        {"messages": msgs, "tools": [WEATHER], "tool_choice": named, "temperature": 0, "max_tokens": 64},
    )
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"] and e["choices"][0]["delta"].get("tool_calls")]
    assert len(deltas) == 1 and deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a conversation with an earlier call and its result, and tool_choice auto / none
    history = msgs + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "12:00"},
    ]
    for choice in ("auto", "none"):
        status, out, _ = _chat(server, messages=history, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=8)
        assert status == 200, out


def test_objects_with_properties_are_closed_by_default(model_dirs):  # noqa: F811
    """As SGLang's default backend (xgrammar, strict mode) compiles schemas: an object listing its
    properties admits no others unless the schema says so; free-form objects and allOf merges stay
    as written. Checked on the grammar itself: what its matcher accepts."""
    from transformers import AutoTokenizer

    from jaxspec.grammar import Grammars, closed_objects
    from jaxspec.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dirs["target"])
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])

    def accepts(schema, text):
        m = grammars.matcher(grammars.check(SamplingParams(json_schema=schema)))
        ids = tok.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    point = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"]}
    assert accepts(point, '{"x":1,"y":2}') and not accepts(point, '{"x":1,"z":2}')
    assert accepts({**point, "additionalProperties": True}, '{"x":1,"z":2}')
    assert accepts({"type": "object"}, '{"z":2}')  # a free-form map stays open
    assert not accepts({"type": "object", "properties": {"p": point}, "required": ["p"]}, '{"p":{"x":1,"z":2}}')
    # a property named "properties" is a property, not the keyword
    odd = closed_objects({"type": "object", "properties": {"properties": {"type": "integer"}}})
    assert odd["properties"] == {"properties": {"type": "integer"}} and odd["additionalProperties"] is False
    # an allOf that merges two objects keeps both sides open (closing one would forbid the other's fields)
    merged = {"$defs": {"A": {"properties": {"a": {}}}}, "allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {}}}]}
    assert closed_objects(merged) == merged


def test_matcher_bookkeeping_takes_eos_after_a_finished_grammar(model_dirs):  # noqa: F811
    """The matcher consumes emitted tokens in whatever pieces the program calls deliver them. A
    grammar that cannot be extended (a regex at its longest, a closed JSON object) stops its matcher
    at its last token, and llguidance refuses the EOS its own mask allowed when the EOS comes in a
    later call: that is not a rejection. A token the grammar forbids is one, kept for the server
    to fail the request with."""
    from transformers import AutoTokenizer

    from jaxspec import grammar
    from jaxspec.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dirs["target"])
    grammars = _grammars(tok)
    ids = tok.encode("red-1234", add_special_tokens=False)
    eos = tok.eos_token_id
    for cut in range(1, len(ids) + 1):  # [..cut] in one call, the rest (with the EOS) in another
        h = grammars.open(grammars.check(SamplingParams(regex=REGEX)))
        out = ids + [eos]
        grammar._entries[h].advance(out, cut, 0)
        grammar._entries[h].advance(out, len(out), 0)
        assert grammar.rejection(h) is None, cut
        grammar.close_handle(h)
    h = grammars.open(grammars.check(SamplingParams(regex=REGEX)))
    bad = tok.encode("purple", add_special_tokens=False)
    grammar._entries[h].advance(bad, len(bad), 0)
    assert "rejected an emitted token" in grammar.rejection(h)
    grammar.close_handle(h)
    assert grammar.rejection(h) is None  # closed: unknown


def _grammars(tok):
    from jaxspec.grammar import Grammars

    return Grammars(tok, len(tok), [tok.eos_token_id])


def test_tool_output_parsing():
    from jaxspec.server import tools

    p = tools.ToolPlan([WEATHER, TIME], "auto")
    content, calls = tools.parse(
        p,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>',
    )
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert tools.parse(p, '{"name": "get_time", "parameters": {}}')[1][0]["function"]["name"] == "get_time"
    assert tools.parse(p, '<tool_call>{"name": "unknown"}</tool_call> hi') == (
        '<tool_call>{"name": "unknown"}</tool_call> hi',
        [],
    )
    assert tools.parse(p, "no call") == ("no call", [])
    required = tools.ToolPlan([WEATHER, TIME], "required")
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]'
    assert [c["function"]["name"] for c in tools.parse(required, two)[1]] == ["get_time", "get_weather"]
    assert tools.parse(required, '[{"name": "get_time", "arguments": {}}, {"name": "nope"}]')[1] == []
    assert tools.parse(required, "[]") == ("[]", [])


def test_openai_sdk_parse(server):
    """The openai SDK's structured-output helper with a pydantic model against `jaxspec serve`."""
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        answer: str = Field(max_length=8)
        confidence: int = Field(ge=0, le=100)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY)
    done = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        response_format=Answer,
        temperature=0,
        max_tokens=64,
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Answer) and 0 <= parsed.confidence <= 100
    # and a tool with a pydantic schema, as agent frameworks send it
    done = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[openai.pydantic_function_tool(Answer, name="report")],
        tool_choice={"type": "function", "function": {"name": "report"}},
        temperature=0,
        max_tokens=64,
    )
    call = done.choices[0].message.tool_calls[0]
    assert call.function.name == "report" and isinstance(call.function.parsed_arguments, Answer)
    # the SDK's streaming helper, which assembles tool calls from the deltas
    with client.chat.completions.stream(
        model="default",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[openai.pydantic_function_tool(Answer, name="report")],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
    ) as stream:
        for _ in stream:
            pass
        done = stream.get_final_completion()
    calls = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name == "report" and isinstance(c.function.parsed_arguments, Answer) for c in calls)


def test_instructor(server):
    """instructor, as agent code uses it against `jaxspec serve`: a pydantic model through a forced
    tool call (its default mode, with its validation retries) and through response_format."""
    instructor = pytest.importorskip("instructor")
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=99_999_999)
        capital: bool

    raw = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(raw, mode=mode)
        city, done = client.chat.completions.create_with_completion(
            model="default",
            response_model=City,
            messages=[{"role": "user", "content": "Describe Oslo."}],
            temperature=0,
            max_tokens=64,
            max_retries=1,
        )
        assert isinstance(city, City) and 0 <= city.population <= 99_999_999, mode
        assert done.usage.completion_tokens <= 64, mode
        if mode == instructor.Mode.TOOLS:
            assert done.choices[0].finish_reason == "tool_calls"
            assert done.choices[0].message.tool_calls[0].function.name == "City"

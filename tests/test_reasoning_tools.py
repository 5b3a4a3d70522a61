"""Qwen3's server habits: `--reasoning-parser qwen3` (server/reasoning.py), `--tool-call-parser
qwen25` (server/tool_parsers.py), their assembly into messages and deltas (server/chat_output.py),
and `chat_template_kwargs` / `separate_reasoning` / `stream_reasoning` on /v1/chat/completions.

The parsers run on hand-written transcripts, whole and streamed in every cut into two and three
pieces (tags split anywhere): the streamed pieces always add up to the whole output's split, and
think text never reaches the content. Over HTTP, a tiny random model served with both parsers:
  * real generation, with a chat template that opens the think block unless
    `enable_thinking` is false, checks that chat_template_kwargs reach the template and that the
    prompt's open block makes the whole output reasoning (streamed: reasoning deltas only);
  * scripted generation: the server's context is given a fake scheduler stream (`merged`) that
    emits a chosen transcript in chosen deltas (here `<think>` and `<tool_call>` split across
    them), so the route's parsing, chunking and finish_reason are checked on text the random
    model would never write.
"""

from __future__ import annotations

import itertools
import json
import types

import pytest

from jaxspec.server.chat_output import ChatParsing
from jaxspec.server.reasoning import ReasoningParser
from jaxspec.server.tool_parsers import ToolCallParser
from jaxspec.server.tools import ToolPlan

from helpers import model_dirs, start  # noqa: F401 - model_dirs is a fixture

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

# (output, prompt opened the block, reasoning, content)
THINK = [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", False, "Let me see.", "It is 4."),
    ("  <think>a < b, so</think>yes", False, "a < b, so", "yes"),
    ("Let me see.\n</think>\n\nIt is 4.", True, "Let me see.", "It is 4."),
    ("<think>\nstill thinking </thi", False, "still thinking </thi", ""),  # stopped before </think>
    ("cut short", True, "cut short", ""),
    ("<think>\nagain\n</think>ok", True, "again", "ok"),  # the block opened twice: one <think> dropped
    ("</think>\n\nok", True, "", "ok"),
    ("It is 4.", False, "", "It is 4."),
    ("<thin", False, "", "<thin"),  # a beginning of <think> that never finished: content
    ("<think></think>", False, "", ""),
    ("<think>x</think>a </think> b", False, "x", "a </think> b"),  # only the first </think> counts
    ("\n\n", False, "", ""),
]


def cuts(text: str, pieces: int):
    """Every way to cut text into `pieces` pieces (some possibly empty)."""
    for points in itertools.combinations_with_replacement(range(len(text) + 1), pieces - 1):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(parser, pieces):
    r = c = ""
    for p in pieces:
        dr, dc = parser.feed(p)
        r, c = r + dr, c + dc
    dr, dc = parser.finish()
    return r + dr, c + dc


@pytest.mark.parametrize("text,opened,reasoning,content", THINK)
def test_reasoning_parser_whole_and_every_split(text, opened, reasoning, content):
    assert ReasoningParser("qwen3", opened).split(text) == (reasoning, content)
    for n in (2, 3):
        for pieces in cuts(text, n):
            assert streamed(ReasoningParser("qwen3", opened), pieces) == (reasoning, content), pieces
    one_char = list(text)
    assert streamed(ReasoningParser("qwen3", opened), one_char) == (reasoning, content)


def test_think_text_never_reaches_content_while_streaming():
    text = "<think>\nsecret plan\n</think>\n\nThe answer."
    for pieces in cuts(text, 3):
        p = ReasoningParser("qwen3")
        released = "".join(p.feed(x)[1] for x in pieces) + p.finish()[1]
        assert released == "The answer." and "secret" not in released and "think" not in released


TOOLS = [
    (CALL, None, [("get_weather", {"city": "Oslo"})]),
    (
        "Checking.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome"),
        "Checking.",
        [("get_weather", {"city": "Oslo"})] * 1 + [("get_weather", {"city": "Rome"})],
    ),
    (CALL + "\nDone.", "Done.", [("get_weather", {"city": "Oslo"})]),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        [],
    ),
    ('<tool_call>\n{"name": "get_weather", "arguments": {}}', None, [("get_weather", {})]),  # left open, JSON complete
    ('Hi <tool_call>\n{"name": "get_wea', 'Hi<tool_call>\n{"name": "get_wea', []),  # cut mid-block: content
    ("a <tool_ca", "a <tool_ca", []),
    ("plain answer", "plain answer", []),
]


@pytest.mark.parametrize("text,content,calls", TOOLS)
def test_tool_call_parser_whole_and_every_split(text, content, calls):
    def check(parser_out):
        got_content, got_calls = parser_out
        assert got_content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
        for c in got_calls:
            assert c["type"] == "function" and c["id"].startswith("call_")

    check(ToolCallParser({"get_weather"}).parse(text))
    for pieces in itertools.chain(cuts(text, 2), [list(text)]):
        p = ToolCallParser({"get_weather"})
        events = [e for x in pieces for e in p.feed(x)] + p.finish()
        check(("".join(e for e in events if isinstance(e, str)) or None, [e for e in events if isinstance(e, dict)]))


def _body(**kw):
    return types.SimpleNamespace(
        chat_template_kwargs=kw.get("kwargs"),
        separate_reasoning=kw.get("separate", True),
        stream_reasoning=kw.get("stream_reasoning", True),
    )


def test_chat_parsing_messages_and_deltas():
    args = {"reasoning_parser": "qwen3", "tool_call_parser": "qwen25"}
    plan = ToolPlan([WEATHER], "auto")
    text = "<think>\nI need the weather.\n</think>\n\n" + CALL
    parsing = ChatParsing.of(args, _body(), plan, "prompt")
    msg = parsing.message(text)
    assert msg["reasoning_content"] == "I need the weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    for pieces in cuts(text, 2):
        out = parsing.new()
        deltas = [d for x in pieces for d in out.feed(x)] + out.finish()
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need the weather."
        assert not any("content" in d for d in deltas)
        (tc,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert tc[0]["index"] == 0 and tc[0]["function"]["name"] == "get_weather" and out.calls == 1
    # the template opened the block: the output holds only </think>
    assert ChatParsing.of(args, _body(), None, "<|im_start|>assistant\n<think>\n").message("hm</think>ok") == {
        "role": "assistant",
        "content": "ok",
        "reasoning_content": "hm",
    }
    # enable_thinking false, or separate_reasoning false: no reasoning split
    for body in (_body(kwargs={"enable_thinking": False}), _body(separate=False)):
        assert ChatParsing.of(args, body, None, "p").message(text) == {"role": "assistant", "content": text}
    # no tool-call parser for a forced call (constrained), nor without the flag: buffered
    assert ChatParsing.of(args, _body(), ToolPlan([WEATHER], "required"), "p").buffered
    assert ChatParsing.of({}, _body(), plan, "p").buffered and ChatParsing.of({}, _body(), None, "p").plain
    # stream_reasoning false: the reasoning arrives in one delta
    out = ChatParsing.of(args, _body(stream_reasoning=False), None, "p").new()
    deltas = [d for x in "<think>a b c</think>done" for d in out.feed(x)] + out.finish()
    assert deltas == [
        {"reasoning_content": "a b c"},
        {"content": "d"},
        {"content": "o"},
        {"content": "n"},
        {"content": "e"},
    ]


# ---- over HTTP -----------------------------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
)
CHAT = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(model_dirs):  # noqa: F811
    s = start(
        model_dirs,
        speculative_algorithm="NONE",
        reasoning_parser="qwen3",
        tool_call_parser="qwen25",
        max_running_requests=2,
        disable_cuda_graph=True,
        max_request_bytes=8192,
    )
    tok = s.sched.eng.tokenizer
    saved, tok.chat_template = tok.chat_template, TEMPLATE
    yield s
    tok.chat_template = saved
    s.stop()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ("nothink", "chat_template_kwargs"),
        ([1, 2], "chat_template_kwargs"),
        ({"tokenize": True}, "chat_template_kwargs: tokenize cannot be set"),
    ],
)
def test_bad_chat_template_kwargs_are_400(server, kwargs, match):
    st, r, _ = server.request("POST", "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": kwargs})
    assert st == 400 and r["error"]["type"] == "BadRequestError" and match in r["error"]["message"], r


def test_template_kwargs_and_reasoning_with_real_generation(server):
    st, r, _ = server.request("POST", "/v1/chat/completions", {"messages": CHAT, **GREEDY})
    assert st == 200, r
    msg = r["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"]  # the prompt opened the block, never closed
    events = server.stream("/v1/chat/completions", {"messages": CHAT, **GREEDY})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not any(d.get("content") for d in deltas)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    body = {"messages": CHAT, **GREEDY, "chat_template_kwargs": {"enable_thinking": False}}
    st, r2, _ = server.request("POST", "/v1/chat/completions", body)
    assert st == 200 and r2["usage"]["prompt_tokens"] > r["usage"]["prompt_tokens"]  # the template saw it
    assert "reasoning_content" not in r2["choices"][0]["message"] and r2["choices"][0]["message"]["content"]


def _script(server, monkeypatch, pieces: list[str], reason: str = "stop"):
    """The server's next requests generate `pieces`, one stream delta each."""
    from jaxspec.server.context import ServerContext

    async def merged(self, request, subs):
        for p in pieces:
            yield 0, {"type": "delta", "text": p, "ids": [0], "logprobs": None}
        meta = {"finish_reason": {"type": reason}, "completion_tokens": len(pieces), "cached_tokens": 0}
        yield (
            0,
            {"type": "done", "result": {"text": "".join(pieces), "output_ids": [0] * len(pieces), "meta_info": meta}},
        )

    def submit_all(self, items):
        return [(types.SimpleNamespace(rid="scripted"), None)]

    monkeypatch.setattr(ServerContext, "merged", merged)
    monkeypatch.setattr(ServerContext, "submit_all", submit_all)


def test_scripted_think_and_tool_call_over_http(server, monkeypatch):
    pieces = [
        "<th",
        "ink>\nWeather",
        " needed.\n</",
        "think>\n\nSure.\n<tool_",
        'call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Oslo"}}\n</tool',
        "_call>",
    ]
    _script(server, monkeypatch, pieces)
    body = {"messages": CHAT, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": True}}
    st, r, _ = server.request("POST", "/v1/chat/completions", body)
    assert st == 200, r
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["reasoning_content"] == "Weather needed." and ch["message"]["content"] == "Sure."
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}

    events = server.stream("/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather needed."
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    assert all("think" not in (d.get("content") or "") and "tool_call" not in (d.get("content") or "") for d in deltas)
    (tc,) = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert tc[0]["index"] == 0 and tc[0]["id"].startswith("call_") and tc[0]["function"]["name"] == "get_weather"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

    # separate_reasoning false: the think block stays in the content; invalid JSON stays content
    _script(server, monkeypatch, ["<think>x</think>", "<tool_call>{bad</tool_call>"])
    st, r, _ = server.request("POST", "/v1/chat/completions", {**body, "separate_reasoning": False})
    ch = r["choices"][0]
    assert st == 200 and ch["finish_reason"] == "stop" and "tool_calls" not in ch["message"]
    assert ch["message"]["content"] == "<think>x</think><tool_call>{bad</tool_call>"

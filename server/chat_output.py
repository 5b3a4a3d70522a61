"""A chat completion's output text as the OpenAI message or deltas it becomes: the reasoning split
off (server/reasoning.py), the tool calls found (server/tool_parsers.py, or server/tools.py's
own parsing without `--tool-call-parser`), the rest content.

`ChatParsing.of(...)` decides, once per request, what applies:
  * the reasoning parser: `--reasoning-parser`, unless the request sets `separate_reasoning` to
    false or passes `chat_template_kwargs: {"enable_thinking": false}`; the output starts inside
    the think block when the rendered prompt ends with `<think>`;
  * a tool-call parser: `--tool-call-parser`, for requests with tools and tool_choice "auto";
  * buffered: requests with tools but no tool-call parser for them (constrained choices, or auto
    without the flag) send their output whole once it is complete, as before.

Per choice, `ChatOutput.feed(piece)` turns a piece of output text into delta dicts
({"reasoning_content": str}, {"content": str} or {"tool_calls": [{index, id, type, function}]})
and `finish()` releases what was held back; `ChatParsing.message(text)` is the non-streamed
{"role", "content", "reasoning_content"?, "tool_calls"?} of a whole output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.server import tools
from jaxspec.server.reasoning import ReasoningParser, prompt_opens_block
from jaxspec.server.tool_parsers import ToolCallParser


@dataclasses.dataclass
class ChatParsing:
    reasoning: str | None = None  # reasoning parser name
    in_reasoning: bool = False  # the prompt opened the think block
    stream_reasoning: bool = True  # False: the reasoning is streamed as one delta once complete
    plan: tools.ToolPlan | None = None
    tool_parser: str | None = None  # tool-call parser name (only with an "auto" plan)

    @classmethod
    def of(cls, server_args: dict, body, plan: tools.ToolPlan | None, prompt: str) -> ChatParsing:
        reasoning = server_args.get("reasoning_parser")
        kwargs = body.chat_template_kwargs or {}
        if body.separate_reasoning is False or kwargs.get("enable_thinking") is False:
            reasoning = None
        tool_parser = server_args.get("tool_call_parser") if plan is not None and plan.mode == "auto" else None
        return cls(reasoning, prompt_opens_block(prompt), body.stream_reasoning is not False, plan, tool_parser)

    @property
    def plain(self) -> bool:
        """Nothing to parse: the text is the content, streamed as it comes."""
        return self.reasoning is None and self.plan is None

    @property
    def buffered(self) -> bool:
        """Tools without a parser for them: the output is sent whole once complete."""
        return self.plan is not None and self.tool_parser is None

    def _tool_parser(self) -> ToolCallParser | None:
        if self.tool_parser is None or self.plan is None:
            return None
        return ToolCallParser({t["function"]["name"] for t in self.plan.tools}, self.tool_parser)

    def new(self) -> ChatOutput:
        """The stream parser of one choice."""
        rp = ReasoningParser(self.reasoning, self.in_reasoning) if self.reasoning else None
        return ChatOutput(rp, self._tool_parser(), self.stream_reasoning)

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole output."""
        reasoning, content = "", text
        if self.reasoning:
            reasoning, content = ReasoningParser(self.reasoning, self.in_reasoning).split(text)
        calls: list[dict[str, Any]] = []
        tp = self._tool_parser()
        if tp is not None:
            c, calls = tp.parse(content)
            content = c or ""
        elif self.plan is not None:
            c, calls = tools.parse(self.plan, content)
            content = c or "" if calls else content
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
            msg["content"] = content or None
        if calls:
            msg["content"] = content or None
            msg["tool_calls"] = calls
        return msg


class ChatOutput:
    """One choice's output, streamed: pieces of text in, delta dicts out."""

    def __init__(self, reasoning: ReasoningParser | None, tool_parser: ToolCallParser | None, stream_reasoning: bool):
        self.reasoning, self.tools, self.stream_reasoning = reasoning, tool_parser, stream_reasoning
        self.calls = 0  # tool calls sent so far
        self.held_reasoning = ""  # stream_reasoning false: the reasoning until it is complete

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._content(piece, [])
        r, c = self.reasoning.feed(piece)
        return self._content(c, self._reasoning(r, done=bool(c)))

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        c = ""
        if self.reasoning is not None:
            r, c = self.reasoning.finish()
            out = self._reasoning(r, done=True)
        out = self._content(c, out)
        if self.tools is not None:
            out += self._events(self.tools.finish())
        return out

    def _reasoning(self, text: str, done: bool) -> list[dict[str, Any]]:
        if not self.stream_reasoning:
            self.held_reasoning += text
            text, self.held_reasoning = (self.held_reasoning, "") if done else ("", self.held_reasoning)
        return [{"reasoning_content": text}] if text else []

    def _content(self, text: str, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.tools is None:
            return out + [{"content": text}] if text else out
        return out + self._events(self.tools.feed(text)) if text else out

    def _events(self, events: list) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, str):
                out.append({"content": e})
            else:
                out.append({"tool_calls": [{"index": self.calls, **e}]})
                self.calls += 1
        return out

"""Tool-call parsers (`--tool-call-parser`): tool calls found in a chat completion's free text.

They apply to requests that offer tools with tool_choice "auto" (server/tools.py; the other
choices constrain the output instead). The content they get is the output after any reasoning
was split off (server/reasoning.py).

qwen25  Qwen2.5's and Qwen3's format (the Hermes convention), one block per call:
            <tool_call>
            {"name": "get_weather", "arguments": {"city": "Oslo"}}
            </tool_call>
        A block whose JSON is invalid, or names no offered tool, stays in the content as it was
        written. A block left open when the output ends is a call if its JSON is complete.
        Whitespace at the start of the output and next to the blocks is dropped.

`ToolCallParser.feed(piece)` takes the text a piece at a time (pieces may split the tags
anywhere) and returns events: `str` (content to release) or `dict` (a complete call, in OpenAI's
form: {"id", "type": "function", "function": {"name", "arguments": a JSON string}}); text that
could still be the start of a block is held back until the next piece or `finish()`. The events
of any split of an output are those of the whole output, up to how the content is cut.
"""

from __future__ import annotations

from typing import Any

from jaxspec.args import TOOL_CALL_PARSERS as PARSERS
from jaxspec.server.reasoning import _partial_suffix
from jaxspec.server.tools import _as_call, _loads

OPEN, CLOSE = "<tool_call>", "</tool_call>"

Event = str | dict[str, Any]


class ToolCallParser:
    """Finds the tool calls of one output (a choice) among `names`, the offered functions."""

    def __init__(self, names: set[str], name: str = "qwen25"):
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r} (one of {', '.join(PARSERS)})")
        self.names = names
        self.buf = ""
        self.inside = False  # in a block (after its <tool_call>)
        self.lead = True  # whitespace here is dropped: the start of the output, or just after a block

    def feed(self, piece: str) -> list[Event]:
        self.buf += piece
        out: list[Event] = []
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                out.append(self._block(self.buf[:end], closed=True))
                self.buf, self.inside, self.lead = self.buf[end + len(CLOSE) :], False, True
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                text = self.buf[:start].rstrip()  # whitespace before a block is dropped
                self.buf, self.inside = self.buf[start + len(OPEN) :], True
                self._content(text, out)
                continue
            held = _partial_suffix(self.buf, OPEN)
            text = self.buf[: len(self.buf) - held]
            keep = len(text) - len(text.rstrip())  # trailing whitespace may come just before a block
            self.buf = self.buf[len(text) - keep :]
            self._content(text[: len(text) - keep], out)
            return out

    def _content(self, text: str, out: list[Event]) -> None:
        if self.lead:
            text = text.lstrip()
        if text:
            self.lead = False
            out.append(text)

    def _block(self, body: str, closed: bool) -> Event:
        """A call, or the block's text as content."""
        call = _as_call(_loads(body.strip()), self.names)
        if call is not None:
            return call
        text = OPEN + body + (CLOSE if closed else "")
        self.lead = False
        return text

    def finish(self) -> list[Event]:
        """The events still held back once the output is complete."""
        buf, self.buf = self.buf, ""
        out: list[Event] = []
        if self.inside:
            self.inside = False
            ev = self._block(buf, closed=False)
            return [ev] if isinstance(ev, dict) or ev.strip() else []
        self._content(buf.rstrip(), out)
        return out

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole output; content None when empty."""
        events = self.feed(text) + self.finish()
        content = "".join(e for e in events if isinstance(e, str))
        return content or None, [e for e in events if isinstance(e, dict)]

"""Reasoning parsers (`--reasoning-parser`): the model's thinking, split from its answer.

A chat completion's raw output text goes in; two texts come out: the reasoning (returned as
`message.reasoning_content`, or `delta.reasoning_content` when streamed) and the content.

qwen3  Qwen3's `<think> ... </think>` block. The output may open it itself (`<think>` after
       optional whitespace at its very start), or the chat template may already have opened it
       (the rendered prompt ends with `<think>`), in which case the output holds only `</think>`
       (a `<think>` the model writes again at its start is dropped all the same).
       Everything before `</think>` is reasoning, everything after it content; if generation
       stops before `</think>`, all of the output is reasoning. An output that neither starts
       inside the block nor begins with `<think>` is all content (as with
       `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an empty block
       in the prompt). Whitespace around the reasoning and at the start of the content is
       dropped.

`ReasoningParser.feed(piece)` takes the output a piece at a time (pieces may split the tags
anywhere) and returns the (reasoning, content) text it can release so far; text that could still
be part of a tag, or whitespace that could still be trailing, is held back until the next piece
or `finish()`. The pieces it releases always concatenate to what `split(text)` returns for the
whole output, however the output was cut.
"""

from __future__ import annotations

from jaxspec.args import REASONING_PARSERS as PARSERS

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_block(prompt: str) -> bool:
    """Whether the rendered chat prompt ends inside an open think block (the output then starts
    in the reasoning)."""
    return prompt.rstrip().endswith(OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Splits one output (a choice) into reasoning and content, streamed or whole.

    in_reasoning: the output starts inside the think block (the prompt opened it)."""

    def __init__(self, name: str = "qwen3", in_reasoning: bool = False):
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r} (one of {', '.join(PARSERS)})")
        self.in_reasoning = in_reasoning
        self.state = "start"  # start | reasoning | content
        self.buf = ""  # held back text
        self.lead = True  # the current part has released nothing yet (its leading whitespace is dropped)

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) released by one more piece of the output."""
        self.buf += piece
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if OPEN.startswith(head):  # empty, whitespace, or a beginning of <think>
                return "", ""
            if head.startswith(OPEN):
                self.state, self.buf, self.lead = "reasoning", head[len(OPEN) :], True
            else:
                self.state = "reasoning" if self.in_reasoning else "content"
        if self.state == "reasoning":
            end = self.buf.find(CLOSE)
            if end < 0:
                keep = self.buf[: len(self.buf) - _partial_suffix(self.buf, CLOSE)].rstrip()
                reasoning, self.buf = self._release(keep), self.buf[len(keep) :]
                return reasoning, ""
            reasoning = self._release(self.buf[:end].rstrip())
            self.state, self.buf, self.lead = "content", self.buf[end + len(CLOSE) :], True
        content, self.buf = self._release(self.buf), ""
        return reasoning, content

    def _release(self, text: str) -> str:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        return text

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held back once the output is complete."""
        buf, self.buf = self.buf, ""
        if self.state == "reasoning":  # stopped before </think>: a partial tag is reasoning too
            return self._release(buf.rstrip()), ""
        if self.state == "start" and self.in_reasoning:
            return self._release(buf.strip()), ""
        self.state = "content"  # from start: whitespace or a beginning of <think>, which is content
        return "", self._release(buf)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

"""Incremental detokenizing for streaming, with stop strings.

Each step decodes only the tokens after a few tokens of left context (which keep word-initial
spaces and multi-byte characters right), so a long output costs O(n), not O(n^2); the final text
is one full decode, as the offline engine's. Text that could be the start of a stop string is held
back until it is known not to be one.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from jaxspec.requests import cut_at_stop_string

LEFT_CONTEXT = 4  # tokens decoded again before the new ones


@dataclasses.dataclass
class DetokState:
    """One request's streaming text."""

    text: str = ""
    sent: int = 0  # characters of text already streamed
    prefix_off: int = 0  # left context starts at this token
    read_off: int = 0  # tokens already turned into text


def detokenize(
    tok: Any,
    lock: threading.Lock,
    st: DetokState,
    out_ids: list[int],
    stops: list[str],
    skip_special_tokens: bool,
    final: bool,
) -> tuple[str, list[int], dict[str, Any] | None]:
    """Extends st.text by the tokens of out_ids past st.read_off. Returns (text to stream now,
    out_ids cut after a stop string, the stop-string finish reason or None). lock: held around the
    tokenizer (HF tokenizers are not safe to share across threads)."""
    with lock:
        if final:
            text = tok.decode(out_ids, skip_special_tokens=skip_special_tokens)
        else:
            before = tok.decode(out_ids[st.prefix_off : st.read_off], skip_special_tokens=skip_special_tokens)
            after = tok.decode(out_ids[st.prefix_off :], skip_special_tokens=skip_special_tokens)
            text = st.text
            if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
                text = st.text + after[len(before) :]
                st.prefix_off, st.read_off = max(st.read_off - LEFT_CONTEXT, 0), len(out_ids)
    stops = [s for s in stops if s]
    hit = None
    start = max(0, min(st.sent, len(text)) - max((len(s) for s in stops), default=0))
    if stops:
        with lock:
            cut = cut_at_stop_string(
                text, out_ids, stops, lambda x: tok.decode(x, skip_special_tokens=skip_special_tokens), start
            )
        if cut is not None:
            text, out_ids, hit = cut
            final = True
    safe = len(text)
    if not final and stops:  # hold back what could be the start of a stop string
        safe -= max(len(s) for s in stops) - 1
    safe = max(safe, st.sent)
    delta = text[st.sent : safe]
    st.sent = safe
    st.text = text
    return delta, out_ids, hit

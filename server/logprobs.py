"""Token logprobs in the OpenAI response formats, from the (logprob, [(id, logprob)]) rows the
scheduler and the engine produce (jaxspec/requests.py: TokenLogprobRows).

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's text is the tokenizer's decoding of that token alone ("bytes" its UTF-8 bytes); a token
holding part of a multi-byte character decodes to U+FFFD, as in other OpenAI-compatible servers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxspec.requests import TokenLogprobRows


def chat_logprobs(ids: Sequence[int], rows: TokenLogprobRows, text_of: Callable[[int], str]) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = text_of(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]} for t, (lp, top) in zip(ids, rows)],
        "refusal": None,
    }


def completion_logprobs(
    ids: Sequence[int],
    rows: TokenLogprobRows,
    text_of: Callable[[int], str],
    offset: int = 0,
    first_has_none: bool = False,
) -> dict:
    """offset: where the first token's text starts in the choice's text; first_has_none: the first
    token is the prompt's first (echo), which no position predicts: its logprob is null."""
    tokens = [text_of(t) for t in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    token_lps: list = [lp for lp, _ in rows]
    tops: list = [{text_of(a): b for a, b in top} for _, top in rows]
    if first_has_none and token_lps:
        token_lps[0], tops[0] = None, None
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_completion(a: dict | None, b: dict) -> dict:
    """Completion logprobs of consecutive pieces (the echoed prompt, then the output) as one."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def rows_from_meta(meta: dict) -> TokenLogprobRows:
    """The output tokens' rows back from SGLang's meta_info fields (jaxspec/requests.py)."""
    return [
        (e[0], [(x[1], x[0]) for x in top])
        for e, top in zip(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or [])
    ]

"""What a generation request is, for the offline `Engine` and the server alike: prompt checks, stop
ids, the draft's shifted prompt, finish reasons, stop-string cuts and the result dictionary.

A result is SGLang's `{"text", "output_ids", "meta_info"}`; meta_info holds id, prompt_tokens,
completion_tokens, finish_reason ({"type": "stop", "matched": token id or string} or
{"type": "length", "length": n}), e2e_latency, spec_verify_ct, spec_accept_length and, for
speculative requests, spec_accept_histogram (entry i = rounds that emitted i + 1 tokens).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decode import LENGTH, STOPPED
from jaxspec.errors import JaxspecError
from jaxspec.logprobs import MAX_TOP_LOGPROBS
from jaxspec.sampling import SamplingParams
from jaxspec.speculative.adaptive import OFF


def bucket(n: int, lo: int = 1) -> int:
    """Smallest power of two >= max(n, lo): batch, chunk and length sizes are bucketed so that
    repeated calls reuse compiled programs."""
    return 1 << max(math.ceil(math.log2(max(n, lo, 1))), 0)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def check_prompt(
    ids: Sequence[int], context_length: int, vocab_size: int, name: str = "the prompt", hint: str = ""
) -> None:
    """Raises JaxspecError unless ids is a non-empty prompt of valid token ids leaving room for at
    least one output token. hint: what to do about a prompt that is too long."""
    if len(ids) == 0:
        raise JaxspecError(f"{name} is empty")
    if len(ids) >= context_length:
        raise JaxspecError(
            f"{name} has {len(ids)} tokens, which does not fit the context length "
            f"(context_length={context_length}: prompt + output){hint}"
        )
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise JaxspecError(f"{name} has token ids outside [0, {vocab_size})")


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t in params.stop_token_ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise JaxspecError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")


def stop_token_ids(cfg: ModelConfig, tokenizer: Any, params: SamplingParams) -> list[int]:
    """The token ids that end a request on the device: EOS (unless ignore_eos), stop_token_ids,
    and stop strings that are a single token. Longer stop strings are cut on the host."""
    stop = [] if params.ignore_eos else list(cfg.eos_token_ids)
    if not params.ignore_eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        stop.append(tokenizer.eos_token_id)
    stop += list(params.stop_token_ids or [])
    for s in params.stop_strings:
        if tokenizer is not None:
            t = tokenizer.encode(s, add_special_tokens=False)
            if len(t) == 1:
                stop.append(t[0])
    return sorted(set(stop))


def draft_prompt(prompt: np.ndarray, shift: int) -> np.ndarray:
    """prompt [B, L] -> the draft's prompt [B, L]: shifted left by `shift` (1 for EAGLE: draft entry
    p holds token p + 1), zero-padded on the right."""
    out = np.zeros_like(prompt)
    out[:, : prompt.shape[1] - shift] = prompt[:, shift:]
    return out


def finish_reason(code: int, out_ids: list[int]) -> dict[str, Any] | None:
    """The device's finish code -> SGLang's finish_reason (None: not finished)."""
    if code == STOPPED:
        return {"type": "stop", "matched": out_ids[-1]}
    if code == LENGTH:
        return {"type": "length", "length": len(out_ids)}
    return None


def tokens_through(decode_ids: Callable[[list[int]], str], out_ids: list[int], stop: str) -> int:
    """The fewest leading tokens of out_ids whose decoded text contains `stop` (binary search)."""
    lo, hi = 1, len(out_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stop in decode_ids(out_ids[:mid]) else (mid + 1, hi)
    return lo


def cut_at_stop_string(
    text: str, out_ids: list[int], stops: Sequence[str], decode_ids: Callable[[list[int]], str], start: int = 0
) -> tuple[str, list[int], dict[str, Any]] | None:
    """The earliest stop string found in text[start:]: (text before it, the tokens through it,
    finish reason), or None."""
    found = [(text.find(s, start), s) for s in stops if s and s in text[start:]]
    if not found:
        return None
    pos, s = min(found)
    return text[:pos], out_ids[: tokens_through(decode_ids, out_ids, s)], {"type": "stop", "matched": s}


def make_result(
    rid: str,
    text: str | None,
    out_ids: list[int],
    prompt_tokens: int,
    reason: dict[str, Any],
    latency: float,
    verify_ct: int,
    hist: list[int] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """SGLang's result dictionary. verify_ct: rounds run (plain decoding: one per token); hist:
    histogram of tokens emitted per round (speculative requests); extra: more meta_info fields.

    With adaptive speculation (extra has spec_shapes, rounds per candidate; "off": plain steps),
    the plain steps it chose are reported apart (spec_plain_steps) and left out of spec_verify_ct,
    spec_accept_length and the histogram, which then count speculative rounds only, as SGLang's
    do (spec_accept_length: tokens per round, the first token included; 0 when no round ran)."""
    plain = int((extra.get("spec_shapes") or {}).get(OFF, 0))
    rounds = max(verify_ct - plain, 0)
    spec_tokens = len(out_ids) - plain
    meta = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(out_ids),
        "finish_reason": reason,
        "e2e_latency": latency,
        **extra,
        "spec_verify_ct": rounds,
        "spec_accept_length": spec_tokens / rounds if rounds else (0.0 if plain else float(len(out_ids))),
    }
    if "spec_shapes" in extra:
        meta["spec_plain_steps"] = plain
    if hist is not None:
        h = [int(x) for x in hist]
        if plain and h:  # a plain step counts as a round that emitted one token
            h[0] = max(h[0] - plain, 0)
        meta["spec_accept_histogram"] = h
    return {"text": text, "output_ids": list(out_ids), "meta_info": meta}


# (logprob, [(token id, logprob)] of the top alternatives) per token
TokenLogprobRows = list[tuple[float, list[tuple[int, float]]]]


def logprob_rows(lps, row: int, start: int, count: int, k: int) -> TokenLogprobRows:
    """Tokens [start, start + count) of one row of fetched TokenLogprobs (numpy [B, T(, K)]) as
    (logprob, [(token id, logprob)] of the top k alternatives)."""
    tok, ids, top = lps.tok[row], lps.top_ids[row], lps.top_lp[row]
    return [
        (float(tok[i]), [(int(a), float(b)) for a, b in zip(ids[i, :k], top[i, :k])])
        for i in range(start, start + count)
    ]


def output_logprobs(ids: Sequence[int], rows: TokenLogprobRows) -> dict[str, Any]:
    """SGLang's meta_info fields for the generated tokens: output_token_logprobs [[logprob, id,
    text]] and output_top_logprobs [[[logprob, id, text], ...]] (text None; see with_token_text)."""
    return {
        "output_token_logprobs": [[lp, int(t), None] for t, (lp, _) in zip(ids, rows)],
        "output_top_logprobs": [[[b, a, None] for a, b in top] for _, top in rows],
    }


def input_logprobs(ids: Sequence[int], rows: TokenLogprobRows, start: int) -> dict[str, Any]:
    """SGLang's meta_info fields for prompt tokens [start, len(ids)): input_token_logprobs and
    input_top_logprobs; rows[i] scores ids[i] (the first prompt token has no logprob: None)."""
    out = [[None if i == 0 else rows[i][0], int(ids[i]), None] for i in range(start, len(ids))]
    top = [None if i == 0 else [[b, a, None] for a, b in rows[i][1]] for i in range(start, len(ids))]
    return {"input_token_logprobs": out, "input_top_logprobs": top}


def with_token_text(meta: dict[str, Any], decode_one: Callable[[int], str]) -> None:
    """Fills the text slot of every [logprob, id, text] entry of meta's logprob fields (SGLang's
    return_text_in_logprobs)."""
    for key in ("input_token_logprobs", "output_token_logprobs"):
        for e in meta.get(key) or []:
            e[2] = decode_one(e[1])
    for key in ("input_top_logprobs", "output_top_logprobs"):
        for row in meta.get(key) or []:
            for e in row or []:
                e[2] = decode_one(e[1])


@dataclasses.dataclass(frozen=True)
class LogprobArgs:
    """What a generate() call asked for besides tokens (SGLang's logprob arguments)."""

    top_logprobs_num: int
    logprob_start_len: int
    return_text_in_logprobs: bool

    @classmethod
    def check(cls, ret: bool, top: int, start: int, text: bool) -> LogprobArgs | None:
        if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise JaxspecError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
        if not isinstance(start, int) or start < -1:
            raise JaxspecError(f"logprob_start_len must be -1 (output tokens only) or >= 0, got {start!r}")
        return cls(top, start, text) if ret else None  # as SGLang: the others mean nothing without it


def offline_result(
    tokenizer: Any,
    out_ids: list[int],
    finish: int,
    prompt_len: int,
    p: SamplingParams,
    latency: float,
    verify_ct: int,
    hist,
    used=None,
    lps: TokenLogprobRows | None = None,
    prompt_lps: dict[str, Any] | None = None,
    lp: LogprobArgs | None = None,
) -> dict[str, Any]:
    """The offline engine's result of one request: its text (tokenizer None: none), stop strings
    applied, logprobs (lp, lps [its output rows], prompt_lps) and speculation metrics (hist [D + 2]
    rounds per tokens emitted, used: rounds per adaptive shape)."""
    reason = finish_reason(finish, out_ids)
    if reason is None:  # pragma: no cover - the loop only exits when every slot finished
        raise RuntimeError("decode loop returned an unfinished request")
    text = None
    if tokenizer is not None:
        decode_ids = lambda x: tokenizer.decode(x, skip_special_tokens=p.skip_special_tokens)
        text = decode_ids(out_ids)
        cut = cut_at_stop_string(text, out_ids, p.stop_strings, decode_ids)
        if cut is not None:  # multi-token stop strings are applied after generation
            text, out_ids, reason = cut
    extra: dict[str, Any] = {}
    if used is not None:  # rounds run with each candidate shape
        extra["spec_shapes"] = used
    if lp is not None:
        assert lps is not None  # (the program recorded them: lp was given)
        extra.update(prompt_lps or {})
        extra.update(output_logprobs(out_ids, lps))  # a stop-string cut leaves fewer out_ids
        if lp.return_text_in_logprobs:
            if tokenizer is None:
                raise JaxspecError("return_text_in_logprobs needs a tokenizer")
            with_token_text(extra, lambda t: tokenizer.decode([t]))
    hist = None if hist is None else hist[1:]
    return make_result(uuid.uuid4().hex, text, out_ids, prompt_len, reason, latency, verify_ct, hist, **extra)

"""What the scheduler (server/scheduler.py) keeps: one `Request` per client request, one
`PrefillGroup` per group of requests being prefilled, one `Pending` per device call whose results
are not fetched yet, and the server's running `Stats`."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxspec.sampling import SamplingParams
from jaxspec.server.detokenize import DetokState

logger = logging.getLogger("jaxspec.server")


class QueueFull(Exception):
    """The wait queue is at --max-queued-requests."""


@dataclasses.dataclass(eq=False)
class Request:
    ids: list[int]  # prompt token ids
    params: SamplingParams
    emit: Callable[[dict], None]  # called from the scheduler thread: {"type": "delta" | "done" | "error", ...}
    speculative: bool = True  # False: this request decodes without speculation
    top_logprobs: int | None = None  # report each output token's logprob with this many alternatives
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # filled by the scheduler
    max_new: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled: their KV came from the prefix cache
    out_ids: list[int] = dataclasses.field(default_factory=list)
    # with top_logprobs: per output token (logprob, [(token id, logprob)] of the top alternatives)
    out_lps: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    detok: DetokState = dataclasses.field(default_factory=DetokState)  # the streamed text so far
    slot: int = -1  # its request slot once admitted (-1: none yet)
    verify_ct: int = 0
    hist: list[int] | None = None
    acc: np.ndarray | None = None  # [2, D] rounds that reached / accepted each depth (adaptive speculation)
    shape_rounds: dict[str, int] = dataclasses.field(default_factory=dict)  # rounds per adaptive candidate
    finished: bool = False
    cancelled: bool = False
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter)
    t_first: float | None = None
    decoding: bool = False  # prefilled: its slot takes part in dispatches
    known: int = 0  # tokens (prompt + output) whose results the host has processed
    inflight: int = 0  # dispatches enqueued for this request whose results are not processed yet
    # stop token ids (EOS, stop_token_ids, 1-token stop strings)
    _stops: list[int] = dataclasses.field(default_factory=list)
    _reuse: int = 0  # at admission: prompt positions whose KV its slot holds (or will, once copied)
    grammar: str | None = None  # constrained output: its validated llguidance grammar (jaxspec/grammar.py)
    handle: int = -1  # while decoding a grammar: its matcher's handle (SamplingTensors.grammar)

    @property
    def text(self) -> str:
        return self.detok.text

    def send(self, event: dict) -> None:
        """emit(event), never raising into the scheduler (a client's event loop may be gone)."""
        try:
            self.emit(event)
        except Exception:
            logger.warning("request %s: could not deliver a %s event", self.rid, event.get("type"), exc_info=True)


@dataclasses.dataclass(eq=False)
class PrefillGroup:
    """Requests admitted together, prefilled chunk by chunk (one compiled program per chunk)."""

    reqs: list[Request]
    chunk: int  # prompt tokens per chunk
    keys: list[tuple]  # the compiled program of each chunk (server/program_shapes.py prefill_plan)
    prompt: np.ndarray  # [len(reqs), len(keys) * chunk] int32, zero-padded
    dprompt: np.ndarray  # the draft's prompt (shifted)
    start: int = 0  # the first chunk's position (positions before it are cached)
    next: int = 0  # the next chunk to run

    @property
    def n_chunks(self) -> int:
        return len(self.keys)


@dataclasses.dataclass
class Pending:
    """A device call whose results the host has not fetched yet."""

    kind: str  # "admit" (first tokens) | "dispatch" (k rounds)
    reqs: list[Request]  # admit: the group's requests
    slots: dict[int, Request]  # dispatch: slot -> request
    out: Any  # device arrays
    seq: int = 0  # this call's place among the device calls (Scheduler._seq)
    t_enqueued: float = 0.0
    spec: Any = None  # dispatch: the tree shape it ran (None: plain steps or plain decoding)
    key: tuple = ()  # dispatch: its compiled program
    compiles: tuple[int, int] = (0, 0)  # dispatch: Programs.compile_mark() when it was enqueued

    @property
    def who(self) -> list[Request]:
        return self.reqs if self.kind == "admit" else list(self.slots.values())


@dataclasses.dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    failed: int = 0  # requests ended by an internal error (the server kept running)
    recoveries: int = 0  # times the device state was lost and re-created
    grammar_rejections: int = 0  # constrained requests failed because their matcher refused an emitted token
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled (not cached; padding not counted)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    generation_tokens: int = 0
    spec_tokens: int = 0  # tokens of finished speculative requests, less those of plain steps
    spec_verify_ct: int = 0  # their speculative rounds
    spec_plain_steps: int = 0  # their plain steps (adaptive speculation turned speculation off)
    # tree shape (speculative/adaptive.py shape_label) -> dispatches / rounds run with it
    shape_dispatches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    shape_rounds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # (time, new tokens)
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=4096))

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        n = sum(c for t, c in list(self.recent) if now - t <= window)
        return n / window

"""What every route shares: the scheduler and engine behind the app, and the steps each API takes
with them (parse a body, tokenize, submit requests to the scheduler, follow their events).

`create_app` (server/app.py) stores one `ServerContext` in `app.state.ctx`; a route reads it with
`context(request)`. The scheduler thread reports a request's progress through `Request.emit`, which
the context points at an asyncio queue of the route's event loop: {"type": "delta" | "done" |
"error", ...} events (server/records.py `Request`; sent by server/dispatch.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams
from jaxspec.server.errors import HTTPError, parse_json
from jaxspec.server.scheduler import QueueFull, Scheduler
from jaxspec.server.scheduler import Request as SchedRequest

logger = logging.getLogger("jaxspec.server")

# one submitted request and the queue its events arrive on
Submission = tuple[SchedRequest, asyncio.Queue]


def context(request: Request) -> ServerContext:
    """The ServerContext of the app serving `request`."""
    return request.app.state.ctx


@dataclasses.dataclass(eq=False)
class ServerContext:
    sched: Scheduler
    served_model_name: str
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # /get_server_info reports them

    def __post_init__(self) -> None:
        self.text_of = functools.lru_cache(maxsize=1 << 16)(self._text_of)

    @property
    def eng(self) -> Engine:
        return self.sched.eng

    # ---- bodies and tokens -------------------------------------------------------------------

    async def parse(self, request: Request, model):
        """The JSON body as `model` (whatever the Content-Type: `curl -d` sends form-encoded)."""
        data = parse_json(await request.body())
        body = model.model_validate(data)
        if body.ignored_fields():
            logger.info("%s: ignoring unknown fields %s", request.url.path, ", ".join(body.ignored_fields()))
        return body

    def check_model(self, name: str | None) -> None:
        served = self.served_model_name
        if name not in (None, "", "default", served):
            raise HTTPError(404, f"model {name!r} is not served here; use {served!r} or 'default'", "NotFoundError")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.eng.tokenizer is None:
            raise JaxspecError("this server has no tokenizer; send input_ids")
        with self.sched.tok_lock:
            return self.eng.encode(text, add_special_tokens=add_special_tokens)

    def _text_of(self, t: int) -> str:
        """One token's text (logprob entries); cached per token in text_of."""
        if self.eng.tokenizer is None:
            return f"<token {t}>"
        with self.sched.tok_lock:
            return self.eng.tokenizer.decode([t])

    def decode_ids(self, ids: list[int]) -> str:
        if self.eng.tokenizer is None:
            raise JaxspecError("echo needs a tokenizer; this server has none")
        with self.sched.tok_lock:
            return self.eng.tokenizer.decode(ids)

    async def prompt_rows(self, ids: list[int], temperature: float, k: int):
        """Logprobs of a prompt's tokens (echo, logprob_start_len), off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.eng.prompt_logprob_rows, list(ids), temperature, k)

    # ---- submitting and following requests ---------------------------------------------------

    def submit(
        self, ids: list[int], params: SamplingParams, speculative: bool, top_logprobs: int | None = None
    ) -> Submission:
        sched = self.sched
        if sched.error:
            raise HTTPError(503, f"the scheduler stopped after an internal error: {sched.error}", "ServiceUnavailable")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def emit(event: dict) -> None:  # from the scheduler thread
            loop.call_soon_threadsafe(q.put_nowait, event)

        req = SchedRequest(ids=list(ids), params=params, speculative=speculative, top_logprobs=top_logprobs, emit=emit)
        try:
            sched.submit(req)
        except QueueFull as e:
            raise HTTPError(503, f"server busy: {e}; retry later", "ServiceUnavailable", {"Retry-After": "1"}) from None
        return req, q

    def submit_all(self, items: list[tuple]) -> list[Submission]:
        """submit(*item) for every item, or none of them: a refusal cancels those already queued."""
        subs: list[Submission] = []
        try:
            for item in items:
                subs.append(self.submit(*item))
        except BaseException:
            self.cancel_all(subs)
            raise
        return subs

    def cancel_all(self, subs: list[Submission]) -> None:
        for req, _ in subs:
            self.sched.cancel(req)

    async def events(self, request: Request, req: SchedRequest, q: asyncio.Queue) -> AsyncIterator[dict]:
        """Scheduler events of one request; cancels it if the client goes away."""
        checked = time.monotonic()
        try:
            while True:
                try:
                    e = await asyncio.wait_for(q.get(), timeout=1.0)
                except TimeoutError:
                    e = None
                # also while events keep coming (a non-streaming client is not watched otherwise)
                if time.monotonic() - checked >= 1.0:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        self.sched.cancel(req)
                        return
                if e is None:
                    continue
                yield e
                if e["type"] in ("done", "error"):
                    return
        finally:
            if not req.finished:
                self.sched.cancel(req)

    async def merged(self, request: Request, subs: list[Submission]) -> AsyncIterator[tuple[int, dict]]:
        """(index, event) of several requests as their events come (index: place in subs)."""
        if len(subs) == 1:
            async for e in self.events(request, *subs[0]):
                yield 0, e
            return
        out: asyncio.Queue = asyncio.Queue()

        async def pump(i, req, q):
            try:
                async for e in self.events(request, req, q):
                    await out.put((i, e))
            finally:
                await out.put((i, None))

        tasks = [asyncio.create_task(pump(i, r, q)) for i, (r, q) in enumerate(subs)]
        try:
            left = len(tasks)
            while left:
                i, e = await out.get()
                if e is None:
                    left -= 1
                else:
                    yield i, e
        finally:
            for t in tasks:
                t.cancel()

    async def collect_all(self, request: Request, subs: list[Submission]) -> list[dict]:
        """The results of subs (in order); 500 if one failed, 499 if the client went away."""
        results: dict[int, dict] = {}
        async for i, e in self.merged(request, subs):
            if e["type"] == "error":
                raise HTTPError(500, e["message"], "InternalServerError")
            if e["type"] == "done":
                results[i] = e["result"]
        if len(results) < len(subs):
            raise HTTPError(499, "client disconnected", "ClientClosedRequest")
        return [results[i] for i in range(len(subs))]


# ---- response pieces both APIs use --------------------------------------------------------------

SPEC_METRICS = (
    "speculative",
    "spec_verify_ct",
    "spec_plain_steps",
    "spec_accept_length",
    "spec_accept_histogram",
    "spec_shapes",
    "ttft",
    "e2e_latency",
)


def spec_metrics(res: dict) -> dict:
    """A result's speculation and latency figures (the `spec_metrics` field of OpenAI responses)."""
    m = res["meta_info"]
    return {k: m[k] for k in SPEC_METRICS if k in m}


def finish_fields(res: dict) -> dict:
    r = res["meta_info"]["finish_reason"]
    return {"finish_reason": r["type"], "matched_stop": r.get("matched")}


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"

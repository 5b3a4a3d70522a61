"""The HTTP API: OpenAI-compatible (/v1/chat/completions, /v1/completions, /v1/models) and
SGLang-native (/generate, /get_server_info, /health, /metrics, /flush_cache) endpoints over a Scheduler.

Every error is an OpenAI-style JSON body {"error": {"message", "type", "code"}}, never a
traceback: 400 bad input (too long a prompt, invalid parameters), 401 missing/wrong API key,
404 unknown model, 413 oversized body, 503 (with Retry-After) full queue or shutting down,
500 a bug (logged with its traceback on the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxspec.errors import JaxspecError
from jaxspec.requests import input_logprobs, output_logprobs, with_token_text
from jaxspec.sampling import nth_sample
from server import protocol, tools
from server.logprobs import chat_logprobs, completion_logprobs, merge_completion, rows_from_meta
from server.scheduler import QueueFull, Scheduler
from server.scheduler import Request as SchedRequest

logger = logging.getLogger("jaxspec.server")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers or {}


def error_body(status: int, message: str, type_: str) -> dict:
    return {"object": "error", "error": {"message": message, "type": type_, "param": None, "code": status}}


def _error_response(status, message, type_, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_), status_code=status, headers=headers)


class _BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: API key (all routes but /health) and request-body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"] != "/health":
            auth = headers.get(b"authorization", b"")
            if not hmac.compare_digest(auth, b"Bearer " + self.api_key.encode()):  # constant time
                resp = _error_response(
                    401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "AuthenticationError"
                )
                return await resp(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            resp = _error_response(
                413, f"request body of {int(length)} bytes exceeds the limit of {self.max_body}", "RequestTooLarge"
            )
            return await resp(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise _BodyTooLarge()
            return msg

        return await self.app(scope, counted, send)


def create_app(
    sched: Scheduler,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 16 << 20,
    server_args: dict | None = None,
    manage_scheduler: bool = True,
) -> FastAPI:
    eng = sched.eng

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_scheduler and sched._thread is None:
            sched.start()
        yield
        if manage_scheduler:
            left = sched.running + sched.queue_depth
            logger.warning("shutting down%s", f": cancelling {left} queued or running requests" if left else "")
            await asyncio.get_running_loop().run_in_executor(None, sched.shutdown)

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(HTTPError)
    async def _http_error(request, e: HTTPError):
        return _error_response(e.status, e.message, e.type, e.headers)

    @app.exception_handler(JaxspecError)
    async def _user_error(request, e: JaxspecError):
        return _error_response(400, str(e), "BadRequestError")

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def _validation(request, e):
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            part = f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
            if part not in parts:
                parts.append(part)
        more = f" (and {len(parts) - 4} more)" if len(parts) > 4 else ""
        return _error_response(400, "invalid request: " + "; ".join(parts[:4]) + more, "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request, e: StarletteHTTPException):  # unknown path (404) or method (405)
        type_ = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "BadRequestError")
        return _error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type_, e.headers)

    @app.exception_handler(_BodyTooLarge)
    async def _too_large(request, e):
        return _error_response(413, f"request body exceeds the limit of {max_body_bytes} bytes", "RequestTooLarge")

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(500, f"internal server error: {type(e).__name__}", "InternalServerError")

    # ---- helpers -----------------------------------------------------------------------------

    async def parse(request: Request, model):
        """The JSON body as `model` (whatever the Content-Type: `curl -d` sends form-encoded)."""
        data = parse_json(await request.body())
        body = model.model_validate(data)
        if body.ignored_fields():
            logger.info("%s: ignoring unknown fields %s", request.url.path, ", ".join(body.ignored_fields()))
        return body

    def check_model(name: str | None) -> None:
        if name not in (None, "", "default", served_model_name):
            raise HTTPError(
                404, f"model {name!r} is not served here; use {served_model_name!r} or 'default'", "NotFoundError"
            )

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if eng.tokenizer is None:
            raise JaxspecError("this server has no tokenizer; send input_ids")
        with sched.tok_lock:
            return eng._encode(text, add_special_tokens=add_special_tokens)

    def submit(ids, params, speculative: bool, top_logprobs: int | None = None) -> tuple[SchedRequest, asyncio.Queue]:
        if sched.error:
            raise HTTPError(503, f"the scheduler stopped after an internal error: {sched.error}", "ServiceUnavailable")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req = SchedRequest(
            ids=list(ids),
            params=params,
            speculative=speculative,
            top_logprobs=top_logprobs,
            emit=lambda e: loop.call_soon_threadsafe(q.put_nowait, e),
        )
        try:
            sched.submit(req)
        except QueueFull as e:
            raise HTTPError(503, f"server busy: {e}; retry later", "ServiceUnavailable", {"Retry-After": "1"}) from None
        return req, q

    def submit_all(items: list[tuple]) -> list[tuple[SchedRequest, asyncio.Queue]]:
        """submit(*item) for every item, or none of them: a refusal cancels those already queued."""
        subs: list[tuple[SchedRequest, asyncio.Queue]] = []
        try:
            for item in items:
                subs.append(submit(*item))
        except BaseException:
            for req, _ in subs:
                sched.cancel(req)
            raise
        return subs

    async def events(request: Request, req: SchedRequest, q: asyncio.Queue):
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
                        sched.cancel(req)
                        return
                if e is None:
                    continue
                yield e
                if e["type"] in ("done", "error"):
                    return
        finally:
            if not req.finished:
                sched.cancel(req)

    async def merged(request: Request, subs: list[tuple[SchedRequest, asyncio.Queue]]):
        """(index, event) of several requests as their events come (index: place in subs)."""
        if len(subs) == 1:
            async for e in events(request, *subs[0]):
                yield 0, e
            return
        out: asyncio.Queue = asyncio.Queue()

        async def pump(i, req, q):
            try:
                async for e in events(request, req, q):
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

    async def collect_all(request, subs) -> list[dict]:
        """The results of subs (in order); 500 if one failed, 499 if the client went away."""
        results: dict[int, dict] = {}
        async for i, e in merged(request, subs):
            if e["type"] == "error":
                raise HTTPError(500, e["message"], "InternalServerError")
            if e["type"] == "done":
                results[i] = e["result"]
        if len(results) < len(subs):
            raise HTTPError(499, "client disconnected", "ClientClosedRequest")
        return [results[i] for i in range(len(subs))]

    @functools.lru_cache(maxsize=1 << 16)
    def text_of(t: int) -> str:
        """One token's text (logprob entries)."""
        if eng.tokenizer is None:
            return f"<token {t}>"
        with sched.tok_lock:
            return eng.tokenizer.decode([t])

    def decode_ids(ids: list[int]) -> str:
        if eng.tokenizer is None:
            raise JaxspecError("echo needs a tokenizer; this server has none")
        with sched.tok_lock:
            return eng.tokenizer.decode(ids)

    async def prompt_rows(ids: list[int], temperature: float, k: int):
        """Logprobs of a prompt's tokens (echo, logprob_start_len), off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, eng.prompt_logprob_rows, list(ids), temperature, k)

    def spec_metrics(res: dict) -> dict:
        m = res["meta_info"]
        keys = (
            "speculative",
            "spec_verify_ct",
            "spec_plain_steps",
            "spec_accept_length",
            "spec_accept_histogram",
            "spec_shapes",
            "ttft",
            "e2e_latency",
        )
        return {k: m[k] for k in keys if k in m}

    def finish_fields(res: dict) -> dict:
        r = res["meta_info"]["finish_reason"]
        return {"finish_reason": r["type"], "matched_stop": r.get("matched")}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def openai_run(request: Request, body, prompts: list[list[int]], chat: bool, texts=None, plan=None):
        """One chat or completion request: a choice per prompt and sample (index = prompt * n + j).
        texts: the prompts as the client sent them (echo), None where it sent token ids; plan: the
        chat request's tools (server/tools.py): outputs become tool_calls, streamed as one delta
        each once the output is complete."""
        params = body.sampling(default_max=sched.context_length)
        top = body.top_logprobs_wanted()
        n = body.n
        echo = not chat and body.echo
        subs = submit_all([(ids, nth_sample(params, j), body.speculative, top) for ids in prompts for j in range(n)])
        rid = ("chatcmpl-" if chat else "cmpl-") + subs[0][0].rid
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        # echo: each prompt's text (and its tokens' logprobs) comes before its choices' output
        prefix = [""] * len(prompts)
        prefix_lps: list[dict | None] = [None] * len(prompts)
        if echo:
            try:
                for p, ids in enumerate(prompts):
                    given = texts[p] if texts else None
                    prefix[p] = given if given is not None else decode_ids(ids)
                    if top is not None:
                        rows = await prompt_rows(ids, params.temperature, top)
                        prefix_lps[p] = completion_logprobs(ids, rows, text_of, 0, first_has_none=True)
            except BaseException:
                for req, _ in subs:
                    sched.cancel(req)
                raise

        def logprobs_of(i: int, ids, rows, offset: int) -> dict | None:
            if top is None:
                return None
            if chat:
                return chat_logprobs(ids, rows, text_of)
            return completion_logprobs(ids, rows, text_of, offset)

        def usage_of(results: list[dict]) -> dict:
            prompt_tokens = sum(len(x) for x in prompts)
            completion = sum(r["meta_info"]["completion_tokens"] for r in results)
            cached = sum(r["meta_info"].get("cached_tokens", 0) for r in results[::n])  # each prompt's first sample
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }

        if not body.stream:
            results = await collect_all(request, subs)
            choices = []
            for i, res in enumerate(results):
                p = i // n
                choice = {"index": i, **finish_fields(res)}
                rows = rows_from_meta(res["meta_info"])
                if chat:
                    choice["message"] = {"role": "assistant", "content": res["text"]}
                    choice["logprobs"] = logprobs_of(i, res["output_ids"], rows, 0)
                    if plan is not None:
                        content, calls = tools.parse(plan, res["text"] or "")
                        if calls:
                            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                            if choice["finish_reason"] == "stop":  # a call cut at max_tokens stays "length"
                                choice["finish_reason"] = "tool_calls"
                else:
                    choice["text"] = prefix[p] + (res["text"] or "")
                    lps = logprobs_of(i, res["output_ids"], rows, len(prefix[p]))
                    choice["logprobs"] = None if lps is None else merge_completion(prefix_lps[p], lps)
                choices.append(choice)
            out = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": served_model_name,
                "choices": choices,
                "usage": usage_of(results),
            }
            metrics = [spec_metrics(r) for r in results]
            out["spec_metrics"] = metrics[0] if len(metrics) == 1 else metrics
            return out

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(i: int, piece: str | None, fin: dict | None, lps=None, first: bool = False):
            if chat:
                delta = (
                    {"role": "assistant", "content": piece or ""} if first else ({"content": piece} if piece else {})
                )
                c = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": None}
            else:
                c = {"index": i, "text": piece or "", "logprobs": lps, "finish_reason": None}
            if fin is not None:
                c.update(fin)
            return {
                "id": rid,
                "object": obj + ".chunk" if chat else obj,
                "created": created,
                "model": served_model_name,
                "choices": [c],
            }

        async def gen():
            offset = [len(prefix[i // n]) for i in range(len(subs))]  # completions: text_offset so far
            for i in range(len(subs)):
                if chat:
                    yield sse(chunk(i, "", None, first=True))
                elif echo:
                    yield sse(chunk(i, prefix[i // n], None, prefix_lps[i // n]))
            results: dict[int, dict] = {}
            async for i, e in merged(request, subs):
                if plan is not None and e["type"] == "delta":  # tool requests: sent whole when done
                    continue
                if e["type"] == "delta" and (e["text"] or e.get("logprobs")):
                    lps = None
                    if top is not None:
                        lps = logprobs_of(i, e["ids"], e["logprobs"], offset[i])
                        if not chat:
                            offset[i] = sum(map(len, lps["tokens"]), offset[i])
                    yield sse(chunk(i, e["text"], None, lps))
                elif e["type"] == "error":
                    yield sse(error_body(500, e["message"], "InternalServerError"))
                    break
                elif e["type"] == "done":
                    res = results[i] = e["result"]
                    fin = finish_fields(res)
                    if plan is not None:
                        content, calls = tools.parse(plan, res["text"] or "")
                        if calls:
                            if fin["finish_reason"] == "stop":
                                fin["finish_reason"] = "tool_calls"
                            delta = [{**c, "index": j} for j, c in enumerate(calls)]
                            c = chunk(i, None, None)
                            c["choices"][0]["delta"] = {
                                "tool_calls": delta,
                                **({"content": content} if content else {}),
                            }
                            yield sse(c)
                        elif content:
                            yield sse(chunk(i, content, None))
                    last = chunk(i, None, fin)
                    last["spec_metrics"] = spec_metrics(res)
                    yield sse(last)
            if include_usage and len(results) == len(subs):
                yield sse(
                    {
                        "id": rid,
                        "object": obj + ".chunk" if chat else obj,
                        "created": created,
                        "model": served_model_name,
                        "choices": [],
                        "usage": usage_of([results[i] for i in range(len(subs))]),
                    }
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---- endpoints ---------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if sched.error:
            return _error_response(503, f"scheduler stopped: {sched.error}", "ServiceUnavailable")
        if sched.recovering:
            return _error_response(
                503,
                f"re-creating the device state after an error: {sched.last_recovery}",
                "ServiceUnavailable",
                {"Retry-After": "1"},
            )
        if sched.stats.recoveries:
            return PlainTextResponse(
                f"ok (device state re-created {sched.stats.recoveries} times; last: {sched.last_recovery})"
            )
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "jaxspec",
                    "root": served_model_name,
                    "max_model_len": sched.context_length,
                }
            ],
        }

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"))
    async def chat_completions(request: Request):
        body = await parse(request, protocol.ChatCompletionRequest)
        check_model(body.model)
        body.sampling(default_max=sched.context_length)  # validate before tokenizing
        plan = tools.plan(body)
        tok = eng.tokenizer
        takes_tools = tok is not None and "tools" in (getattr(tok, "chat_template", None) or "")
        conv, template_tools = tools.messages(body, plan, takes_tools)
        with sched.tok_lock:
            try:
                text = eng.apply_chat_template(conv, template_tools)
            except JaxspecError:
                raise
            except Exception as e:
                raise JaxspecError(f"messages: the model's chat template rejected this conversation: {e}") from None
        return await openai_run(request, body, [encode(text, add_special_tokens=False)], chat=True, plan=plan)

    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"))
    async def completions(request: Request):
        body = await parse(request, protocol.CompletionRequest)
        check_model(body.model)
        body.sampling(default_max=sched.context_length)
        prompts = body.prompts()
        ids = [encode(p) if isinstance(p, str) else list(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return await openai_run(request, body, ids, chat=False, texts=texts)

    @app.post("/generate", openapi_extra=_body("GenerateRequest"))
    async def generate(request: Request):
        body = await parse(request, protocol.GenerateRequest)
        params = body.sampling()
        ids = encode(body.text) if body.text is not None else body.input_ids
        top = body.top_logprobs_num if body.return_logprob else None
        n = body.n
        subs = submit_all([(ids, nth_sample(params, j), body.speculative, top) for j in range(n)])
        prompt_meta: dict = {}
        if body.return_logprob and body.logprob_start_len >= 0:
            try:
                rows = await prompt_rows(ids, params.temperature, body.top_logprobs_num)
            except BaseException:
                for req, _ in subs:
                    sched.cancel(req)
                raise
            prompt_meta = input_logprobs(ids, rows, min(body.logprob_start_len, len(ids)))

        def finished(res: dict, i: int) -> dict:
            meta = res["meta_info"]
            meta.update(copy.deepcopy(prompt_meta))
            if body.return_text_in_logprobs:
                with_token_text(meta, text_of)
            if n > 1:
                res["index"] = i
            return res

        if not body.stream:
            results = [finished(r, i) for i, r in enumerate(await collect_all(request, subs))]
            return results[0] if n == 1 else results

        async def gen():
            text, out_ids, rows = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
            async for i, e in merged(request, subs):
                if e["type"] == "delta":
                    text[i] += e["text"]
                    out_ids[i] += e["ids"]
                    meta = {"id": subs[i][0].rid, "completion_tokens": len(out_ids[i]), "finish_reason": None}
                    if top is not None:
                        rows[i] += e["logprobs"]
                        meta.update(output_logprobs(out_ids[i], rows[i]))
                        if body.return_text_in_logprobs:
                            with_token_text(meta, text_of)
                    piece = {"text": text[i], "output_ids": list(out_ids[i]), "meta_info": meta}
                    if n > 1:
                        piece["index"] = i
                    yield sse(piece)
                elif e["type"] == "error":
                    yield sse(error_body(500, e["message"], "InternalServerError"))
                    break
                elif e["type"] == "done":
                    yield sse(finished(e["result"], i))
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/get_server_info")
    async def server_info():
        acc = sched.avg_spec_accept_length
        internal = {
            "avg_spec_accept_length": acc,
            "last_gen_throughput": sched.stats.tokens_per_s(),
            "num_running_reqs": sched.running,
            "num_queue_reqs": sched.queue_depth,
            "memory_plan": dataclasses.asdict(sched.memory_plan),
            "memory": sched.memory_report(),
        }
        return {
            **(server_args or {}),
            "served_model_name": served_model_name,
            "speculative_algorithm": eng.spec.algorithm,
            "speculative_num_steps": eng.spec.num_steps,
            "speculative_eagle_topk": eng.spec.eagle_topk,
            "speculative_num_draft_tokens": eng.spec.num_draft_tokens,
            "speculative_adaptive": eng.spec.adaptive,
            "context_length": sched.context_length,
            "max_running_requests": sched.slots,
            "num_continuous_decode_steps": sched.k,
            "overlap_schedule": sched.overlap,
            "avg_spec_accept_length": acc,
            "internal_states": [internal],
        }

    async def flush_cache():
        """SGLang's: forgets every cached prefix (running requests keep theirs)."""
        n = sched.flush_cache()
        return PlainTextResponse(f"Cache flushed ({n} cached prefixes dropped).\n")

    app.get("/flush_cache", operation_id="flush_cache_get")(flush_cache)
    app.post("/flush_cache", operation_id="flush_cache_post")(flush_cache)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(sched, served_model_name), media_type="text/plain; version=0.0.4")

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(protocol.openapi_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def _body(name: str) -> dict:
    """OpenAPI request body of a route that parses its JSON itself (see parse_json)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object: strict JSON (no NaN / Infinity), UTF-8 without unpaired
    surrogates; raises HTTPError 400 naming the problem."""
    try:
        data = json.loads(raw or b"null", parse_constant=_no_constant)
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply", "BadRequestError") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, integers of more than 4300 digits
        raise HTTPError(400, f"the request body is not valid JSON: {e}", "BadRequestError") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", "BadRequestError")
    where = _bad_string(data, "")
    if where is not None:
        raise HTTPError(
            400, f"{where or 'body'}: strings must be valid Unicode (unpaired surrogate)", "BadRequestError"
        )
    return data


def _bad_string(x, path: str) -> str | None:
    """Path of the first string (key or value) holding an unpaired surrogate, else None."""
    stack = [(x, path)]
    while stack:
        x, path = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(x, dict):
            for k, v in x.items():
                p = f"{path}.{k}" if path else str(k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
                stack.append((v, p))
        elif isinstance(x, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(x))
    return None


def prometheus_text(sched: Scheduler, model: str) -> str:
    """Prometheus exposition text (SGLang's metric names under the jaxspec: prefix)."""
    st = sched.stats
    label = '{model_name="' + model.replace('"', "'") + '"}'
    rows: list[tuple[str, str, str, Any]] = [
        ("num_requests_total", "counter", "requests accepted", st.requests),
        ("num_requests_finished_total", "counter", "requests finished (stop or length)", st.finished),
        ("num_requests_aborted_total", "counter", "requests cancelled (client gone or shutdown)", st.aborted),
        ("num_requests_rejected_total", "counter", "requests refused because the queue was full", st.rejected),
        (
            "num_requests_failed_total",
            "counter",
            "requests ended by an internal error (the server kept running)",
            st.failed,
        ),
        ("num_recoveries_total", "counter", "times the device state was lost and re-created", st.recoveries),
        (
            "num_grammar_rejections_total",
            "counter",
            "constrained requests failed because their grammar refused an emitted token (a bug)",
            st.grammar_rejections,
        ),
        (
            "num_compiles_on_demand_total",
            "counter",
            "device programs a request had to wait for (none compiled covered it)",
            sched.programs.compiles_on_demand,
        ),
        (
            "background_compile_remaining",
            "gauge",
            "program shapes the background compile has yet to reach",
            max(sched.programs.background_total - sched.programs.background_done, 0),
        ),
        ("prompt_tokens_total", "counter", "prompt tokens of accepted requests", st.prompt_tokens),
        (
            "prefill_tokens_total",
            "counter",
            "prompt tokens prefilled (not served by the prefix cache)",
            st.prefill_tokens,
        ),
        ("cached_tokens_total", "counter", "prompt tokens served by the prefix cache", st.cached_tokens),
        (
            "cache_hit_rate",
            "gauge",
            "share of the admitted prompt tokens served by the prefix cache",
            round(st.cached_tokens / max(st.cached_tokens + st.prefill_tokens, 1), 4),
        ),
        ("generation_tokens_total", "counter", "generated tokens", st.generation_tokens),
        ("gen_throughput", "gauge", "generated tokens per second over the last 10 s", round(st.tokens_per_s(), 3)),
        (
            "spec_accept_length",
            "gauge",
            "mean tokens per speculative round of finished speculative requests (plain steps left out)",
            sched.avg_spec_accept_length or 0.0,
        ),
        ("spec_verify_ct_total", "counter", "speculative rounds of finished speculative requests", st.spec_verify_ct),
        (
            "spec_plain_steps_total",
            "counter",
            "plain steps of finished speculative requests (adaptive speculation turned speculation off)",
            st.spec_plain_steps,
        ),
        (
            "spec_plain_step_share",
            "gauge",
            "share of those requests' rounds run as plain steps",
            round(sched.plain_step_share, 4),
        ),
        ("num_running_reqs", "gauge", "requests holding a slot", sched.running),
        ("num_queue_reqs", "gauge", "requests waiting for a slot", sched.queue_depth),
        ("max_running_requests", "gauge", "request slots", sched.slots),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP jaxspec:{name} {help_}", f"# TYPE jaxspec:{name} {kind}", f"jaxspec:{name}{label} {value}"]
    if sched.spec is not None:  # per tree shape (adaptive speculation's candidates; "off": plain steps)
        for name, help_, counts in (
            ("spec_shape_dispatches_total", "dispatches run with each tree shape", st.shape_dispatches),
            (
                "spec_shape_rounds_total",
                "rounds run with each tree shape (a plain step counts as one)",
                st.shape_rounds,
            ),
        ):
            out += [f"# HELP jaxspec:{name} {help_}", f"# TYPE jaxspec:{name} counter"]
            out += [f'jaxspec:{name}{label[:-1]},shape="{x}"}} {counts[x]}' for x in sched.shapes]
    return "\n".join(out) + "\n"

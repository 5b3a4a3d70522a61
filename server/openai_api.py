"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions and /v1/completions, streamed
(server-sent events) or not, with `n` samples per prompt, logprobs, echo, tool calls and reasoning
(server/chat_output.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from jaxspec.errors import JaxspecError
from jaxspec.sampling import nth_sample
from jaxspec.server import protocol, tools
from jaxspec.server.chat_output import ChatOutput, ChatParsing
from jaxspec.server.context import ServerContext, Submission, context, finish_fields, spec_metrics, sse
from jaxspec.server.errors import error_body, openapi_body
from jaxspec.server.logprobs import chat_logprobs, completion_logprobs, merge_completion, rows_from_meta

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    ctx = context(request)
    name = ctx.served_model_name
    card = {"id": name, "object": "model", "created": 0, "owned_by": "jaxspec", "root": name}
    return {"object": "list", "data": [{**card, "max_model_len": ctx.sched.context_length}]}


@router.post("/v1/chat/completions", openapi_extra=openapi_body("ChatCompletionRequest"))
async def chat_completions(request: Request):
    ctx = context(request)
    body = await ctx.parse(request, protocol.ChatCompletionRequest)
    ctx.check_model(body.model)
    body.sampling(default_max=ctx.sched.context_length)  # validate before tokenizing
    plan = tools.plan(body)
    tok = ctx.eng.tokenizer
    takes_tools = tok is not None and "tools" in (getattr(tok, "chat_template", None) or "")
    conv, template_tools = tools.messages(body, plan, takes_tools)
    with ctx.sched.tok_lock:
        try:
            text = ctx.eng.apply_chat_template(conv, template_tools, body.chat_template_kwargs)
        except JaxspecError:
            raise
        except Exception as e:
            raise JaxspecError(f"messages: the model's chat template rejected this conversation: {e}") from None
    parsing = ChatParsing.of(ctx.server_args, body, plan, text)
    run = OpenAIRun(ctx, request, body, [ctx.encode(text, add_special_tokens=False)], chat=True, parsing=parsing)
    return await run.respond()


@router.post("/v1/completions", openapi_extra=openapi_body("CompletionRequest"))
async def completions(request: Request):
    ctx = context(request)
    body = await ctx.parse(request, protocol.CompletionRequest)
    ctx.check_model(body.model)
    body.sampling(default_max=ctx.sched.context_length)
    prompts = body.prompts()
    ids = [ctx.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    texts = [p if isinstance(p, str) else None for p in prompts]
    return await OpenAIRun(ctx, request, body, ids, chat=False, texts=texts).respond()


class OpenAIRun:
    """One chat or completion request: a choice per prompt and sample (index = prompt * n + j).

    texts: the prompts as the client sent them (echo), None where it sent token ids; parsing: how a
    chat request's outputs become reasoning, content and tool calls (server/chat_output.py); outputs
    with tools but no tool-call parser for them are streamed whole once complete."""

    def __init__(
        self,
        ctx: ServerContext,
        request: Request,
        body,
        prompts: list[list[int]],
        chat: bool,
        texts=None,
        parsing: ChatParsing | None = None,
    ):
        self.ctx, self.request, self.body, self.prompts, self.chat = ctx, request, body, prompts, chat
        self.texts, self.parsing = texts, parsing or ChatParsing()
        self.params = body.sampling(default_max=ctx.sched.context_length)
        self.top: int | None = body.top_logprobs_wanted()
        self.n: int = body.n
        self.echo = not chat and body.echo
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        # echo: each prompt's text (and its tokens' logprobs) comes before its choices' output
        self.prefix = [""] * len(prompts)
        self.prefix_lps: list[dict | None] = [None] * len(prompts)
        self.subs: list[Submission] = []
        self.rid = ""

    async def respond(self):
        """Submits every choice's request and answers: the whole response, or a stream of chunks."""
        n, body = self.n, self.body
        self.subs = self.ctx.submit_all(
            [(ids, nth_sample(self.params, j), body.speculative, self.top) for ids in self.prompts for j in range(n)]
        )
        self.rid = ("chatcmpl-" if self.chat else "cmpl-") + self.subs[0][0].rid
        if self.echo:
            try:
                await self._echo_prefixes()
            except BaseException:
                self.ctx.cancel_all(self.subs)
                raise
        if body.stream:
            return StreamingResponse(
                self._stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return await self._whole()

    async def _echo_prefixes(self) -> None:
        for p, ids in enumerate(self.prompts):
            given = self.texts[p] if self.texts else None
            self.prefix[p] = given if given is not None else self.ctx.decode_ids(ids)
            if self.top is not None:
                rows = await self.ctx.prompt_rows(ids, self.params.temperature, self.top)
                self.prefix_lps[p] = completion_logprobs(ids, rows, self.ctx.text_of, 0, first_has_none=True)

    def _logprobs(self, ids, rows, offset: int) -> dict | None:
        if self.top is None:
            return None
        if self.chat:
            return chat_logprobs(ids, rows, self.ctx.text_of)
        return completion_logprobs(ids, rows, self.ctx.text_of, offset)

    def _usage(self, results: list[dict]) -> dict:
        prompt_tokens = sum(len(x) for x in self.prompts)
        completion = sum(r["meta_info"]["completion_tokens"] for r in results)
        cached = sum(r["meta_info"].get("cached_tokens", 0) for r in results[:: self.n])  # each prompt's first sample
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        obj = self.object + ".chunk" if chunk and self.chat else self.object
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.ctx.served_model_name,
            "choices": choices,
        }

    async def _whole(self) -> dict:
        results = await self.ctx.collect_all(self.request, self.subs)
        choices = []
        for i, res in enumerate(results):
            p = i // self.n
            choice = {"index": i, **finish_fields(res)}
            rows = rows_from_meta(res["meta_info"])
            if self.chat:
                choice["message"] = {"role": "assistant", "content": res["text"]}
                if not self.parsing.plain:
                    choice["message"] = self.parsing.message(res["text"] or "")
                    if choice["message"].get("tool_calls") and choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"  # a call cut at max_tokens stays "length"
                choice["logprobs"] = self._logprobs(res["output_ids"], rows, 0)
            else:
                choice["text"] = self.prefix[p] + (res["text"] or "")
                lps = self._logprobs(res["output_ids"], rows, len(self.prefix[p]))
                choice["logprobs"] = None if lps is None else merge_completion(self.prefix_lps[p], lps)
            choices.append(choice)
        out = {**self._envelope(choices), "usage": self._usage(results)}
        metrics = [spec_metrics(r) for r in results]
        out["spec_metrics"] = metrics[0] if len(metrics) == 1 else metrics
        return out

    def _chunk(self, i: int, piece: str | None, fin: dict | None, lps=None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": piece or ""} if first else ({"content": piece} if piece else {})
            c = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": None}
        else:
            c = {"index": i, "text": piece or "", "logprobs": lps, "finish_reason": None}
        if fin is not None:
            c.update(fin)
        return self._envelope([c], chunk=True)

    def _delta_chunk(self, i: int, delta: dict, lps=None) -> dict:
        c = self._chunk(i, None, None, lps)
        c["choices"][0]["delta"] = delta
        return c

    def _buffered_chunks(self, i: int, res: dict, fin: dict) -> list[dict]:
        """A tool request without a tool-call parser for it, sent whole once done: its reasoning,
        then its calls as one delta (fin's reason becomes "tool_calls"), or its text."""
        msg = self.parsing.message(res["text"] or "")
        out = (
            [self._delta_chunk(i, {"reasoning_content": msg["reasoning_content"]})]
            if msg.get("reasoning_content")
            else []
        )
        content, calls = msg["content"], msg.get("tool_calls")
        if not calls:
            return out + ([self._chunk(i, content, None)] if content else [])
        if fin["finish_reason"] == "stop":
            fin["finish_reason"] = "tool_calls"
        delta = [{**call, "index": j} for j, call in enumerate(calls)]
        return out + [self._delta_chunk(i, {"tool_calls": delta, **({"content": content} if content else {})})]

    def _parsed_chunks(self, i: int, out: ChatOutput, deltas: list[dict], lps=None) -> list[dict]:
        """Chunks of parsed deltas (the logprobs ride on the first; alone if the parsers held all back)."""
        chunks = [self._delta_chunk(i, d, lps if j == 0 else None) for j, d in enumerate(deltas)]
        if not chunks and lps is not None:
            chunks = [self._delta_chunk(i, {}, lps)]
        return chunks

    async def _stream(self) -> AsyncIterator[str]:
        n, top = self.n, self.top
        offset = [len(self.prefix[i // n]) for i in range(len(self.subs))]  # completions: text_offset so far
        for i in range(len(self.subs)):
            if self.chat:
                yield sse(self._chunk(i, "", None, first=True))
            elif self.echo:
                yield sse(self._chunk(i, self.prefix[i // n], None, self.prefix_lps[i // n]))
        results: dict[int, dict] = {}
        parsing = self.parsing
        passthrough = not self.chat or parsing.plain or parsing.buffered
        outs = [] if passthrough else [parsing.new() for _ in self.subs]  # each choice's stream parser
        async for i, e in self.ctx.merged(self.request, self.subs):
            if self.chat and parsing.buffered and e["type"] == "delta":  # sent whole when done
                continue
            if e["type"] == "delta" and (e["text"] or e.get("logprobs")):
                lps = None if top is None else self._logprobs(e["ids"], e["logprobs"], offset[i])
                if lps is not None and not self.chat:
                    offset[i] += sum(len(t) for t in lps["tokens"])
                if outs:
                    for c in self._parsed_chunks(i, outs[i], outs[i].feed(e["text"] or ""), lps):
                        yield sse(c)
                else:
                    yield sse(self._chunk(i, e["text"], None, lps))
            elif e["type"] == "error":
                yield sse(error_body(500, e["message"], "InternalServerError"))
                break
            elif e["type"] == "done":
                res = results[i] = e["result"]
                fin = finish_fields(res)
                if self.chat and parsing.buffered:
                    for c in self._buffered_chunks(i, res, fin):
                        yield sse(c)
                elif outs:
                    for c in self._parsed_chunks(i, outs[i], outs[i].finish()):
                        yield sse(c)
                    if outs[i].calls and fin["finish_reason"] == "stop":
                        fin["finish_reason"] = "tool_calls"
                last = self._chunk(i, None, fin)
                last["spec_metrics"] = spec_metrics(res)
                yield sse(last)
        if self.body.stream_options and self.body.stream_options.include_usage and len(results) == len(self.subs):
            usage = self._usage([results[i] for i in range(len(self.subs))])
            yield sse({**self._envelope([], chunk=True), "usage": usage})
        yield "data: [DONE]\n\n"

"""SGLang's native routes: /generate (text or token ids in, text, ids and meta_info out, streamed
or not), /health, /get_server_info (also /server_info), /get_model_info (also /model_info),
/flush_cache and /metrics; and /save_draft (the head online draft training adapted). SGLang's
router reads /health, /server_info and /model_info of each worker it routes to."""

from __future__ import annotations

import copy
import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from jaxspec.errors import JaxspecError
from jaxspec.requests import input_logprobs, output_logprobs, with_token_text
from jaxspec.sampling import nth_sample
from jaxspec.server import protocol
from jaxspec.server.context import context, sse
from jaxspec.server.errors import error_body, error_response, openapi_body
from jaxspec.server.metrics import prometheus_text

router = APIRouter()


@router.post("/generate", openapi_extra=openapi_body("GenerateRequest"))
async def generate(request: Request):
    ctx = context(request)
    body = await ctx.parse(request, protocol.GenerateRequest)
    params = body.sampling()
    ids = ctx.encode(body.text) if body.text is not None else body.input_ids
    top = body.top_logprobs_num if body.return_logprob else None
    n = body.n
    subs = ctx.submit_all([(ids, nth_sample(params, j), body.speculative, top) for j in range(n)])
    prompt_meta: dict = {}
    if body.return_logprob and body.logprob_start_len >= 0:
        try:
            rows = await ctx.prompt_rows(ids, params.temperature, body.top_logprobs_num)
        except BaseException:
            ctx.cancel_all(subs)
            raise
        prompt_meta = input_logprobs(ids, rows, min(body.logprob_start_len, len(ids)))

    def finished(res: dict, i: int) -> dict:
        meta = res["meta_info"]
        meta.update(copy.deepcopy(prompt_meta))
        if body.return_text_in_logprobs:
            with_token_text(meta, ctx.text_of)
        if n > 1:
            res["index"] = i
        return res

    if not body.stream:
        results = [finished(r, i) for i, r in enumerate(await ctx.collect_all(request, subs))]
        return results[0] if n == 1 else results

    async def gen():
        text, out_ids, rows = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
        async for i, e in ctx.merged(request, subs):
            if e["type"] == "delta":
                text[i] += e["text"]
                out_ids[i] += e["ids"]
                meta = {"id": subs[i][0].rid, "completion_tokens": len(out_ids[i]), "finish_reason": None}
                if top is not None:
                    rows[i] += e["logprobs"]
                    meta.update(output_logprobs(out_ids[i], rows[i]))
                    if body.return_text_in_logprobs:
                        with_token_text(meta, ctx.text_of)
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


@router.get("/health")
async def health(request: Request):
    sched = context(request).sched
    if sched.error:
        return error_response(503, f"scheduler stopped: {sched.error}", "ServiceUnavailable")
    if sched.recovering:
        why = f"re-creating the device state after an error: {sched.last_recovery}"
        return error_response(503, why, "ServiceUnavailable", {"Retry-After": "1"})
    if sched.stats.recoveries:
        n, last = sched.stats.recoveries, sched.last_recovery
        return PlainTextResponse(f"ok (device state re-created {n} times; last: {last})")
    return PlainTextResponse("ok")


@router.get("/get_server_info")
@router.get("/server_info", include_in_schema=False)
async def server_info(request: Request):
    ctx = context(request)
    sched = ctx.sched
    spec = sched.spec or ctx.eng.spec  # the shape the server runs (SpecConfig.for_kind)
    acc = sched.avg_spec_accept_length
    internal = {
        "avg_spec_accept_length": acc,
        "last_gen_throughput": sched.stats.tokens_per_s(),
        "num_running_reqs": sched.running,
        "num_queue_reqs": sched.queue_depth,
        "memory_plan": dataclasses.asdict(sched.memory_plan),
        "memory": sched.memory_report(),
    }
    online = None if ctx.eng.online is None else ctx.eng.online.stats()
    if online is not None:
        internal |= online
    shared = ctx.eng.shared_text_stats()
    if shared is not None:  # NGRAM's / the text-match candidates' text shared by requests
        internal["speculative_shared_text"] = shared
    return {
        **ctx.server_args,
        "served_model_name": ctx.served_model_name,
        "speculative_algorithm": spec.algorithm,
        "speculative_num_steps": spec.num_steps,
        "speculative_eagle_topk": spec.eagle_topk,
        "speculative_num_draft_tokens": spec.num_draft_tokens,
        "speculative_adaptive": spec.adaptive,
        "draft_version": None if online is None else online["draft_version"],
        "context_length": sched.context_length,
        "max_running_requests": sched.slots,
        "num_continuous_decode_steps": sched.k,
        "overlap_schedule": sched.overlap,
        "avg_spec_accept_length": acc,
        "internal_states": [internal],
    }


@router.get("/get_model_info")
@router.get("/model_info", include_in_schema=False)
async def model_info(request: Request):
    """SGLang's: what the worker serves (the router names the model after `model_path`)."""
    ctx = context(request)
    eng = ctx.eng
    return {
        "model_path": ctx.served_model_name,
        "tokenizer_path": ctx.served_model_name if eng.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "model_type": eng.cfg.model_type,
        "checkpoint": eng.loaded.path,
    }


async def flush_cache(request: Request):
    """SGLang's: forgets every cached prefix (running requests keep theirs), and the text finished
    requests left for text matching."""
    n = context(request).sched.flush_cache()
    return PlainTextResponse(f"Cache flushed ({n} cached prefixes dropped).\n")


router.get("/flush_cache", operation_id="flush_cache_get")(flush_cache)
router.post("/flush_cache", operation_id="flush_cache_post")(flush_cache)


@router.post("/save_draft", openapi_extra=openapi_body("SaveDraftRequest"))
async def save_draft(request: Request):
    """Writes the draft head in use (adapted by --speculative-online-train) to a directory on the server,
    in the public EAGLE-3 layout: the next start loads it with --speculative-draft-model-path."""
    ctx = context(request)
    body = await ctx.parse(request, protocol.SaveDraftRequest)
    online = ctx.eng.online
    if online is None:
        raise JaxspecError("/save_draft needs --speculative-online-train (the draft in use is its checkpoint)")
    try:
        path = online.save(body.path)
    except OSError as e:
        raise JaxspecError(f"cannot write the draft to {body.path!r}: {e.strerror or e}") from None
    return {"path": path, "draft_version": online.stats()["draft_version"]}


@router.get("/metrics")
async def metrics(request: Request):
    ctx = context(request)
    return PlainTextResponse(prometheus_text(ctx.sched, ctx.served_model_name), media_type="text/plain; version=0.0.4")

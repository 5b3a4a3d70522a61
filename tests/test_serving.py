"""Continuous batching (jaxspec/serving.py + server/scheduler.py) without HTTP.

More requests than slots, joining and leaving between dispatches: every temperature-0 output is
token-identical to the offline engine (which tests/test_speculative.py ties to plain greedy decoding),
for plain decoding and every algorithm, with some requests opting out of speculation. Seeded
sampling reproduces the offline engine's tokens exactly (same keys), so the offline
distribution tests carry over. Cancellation frees the slot and stops it on the device.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from jaxspec.server.memory import release_columns
from jaxspec.server.scheduler import Request, Scheduler

from helpers import add_mtp_modules, make_hf_model, save_eagle_head

V = 16
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4], [4], [2, 3, 4, 5, 6, 7], [3] * 20]
GREEDY = dict(temperature=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("serving")
    tgt = make_hf_model("llama", 3, vocab_size=V, num_hidden_layers=4, initializer_range=0.3)
    tgt.save_pretrained(d / "target")
    make_hf_model("llama", 5, vocab_size=V, num_hidden_layers=1, initializer_range=0.3).save_pretrained(d / "small")
    cfg = tgt.config.to_dict()
    # a checkpoint with 3 NextN MTP layers after the target's 4 (drafts for the multi-layer MTP runs)
    mtp = d / "mtp"
    tgt.save_pretrained(mtp)
    add_mtp_modules(mtp, "NEXTN", 3, seed=7)
    return {
        "target": str(d / "target"),
        "mtp": str(mtp),
        "small": str(d / "small"),
        "eagle3": save_eagle_head(
            d / "eagle3", "EAGLE3", cfg, seed=2, draft_vocab=12, scale=10.0, aux_layer_ids=[0, 1, 2]
        ),
        "hf": tgt,
    }


def engine(models, algo=None, draft=None, **kw):
    spec = {}
    if algo == "NEXTN":  # multi-layer MTP: a chain, one MTP layer per step
        spec = dict(
            speculative_algorithm=algo,
            enable_multi_layer_eagle=True,
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            speculative_draft_model_path=models[draft],
        )
    elif algo:
        spec = dict(
            speculative_algorithm=algo,
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=6,
        )
        if draft:
            spec["speculative_draft_model_path"] = models[draft]
    kw = {"chunked_prefill_size": 4, **kw}
    return Engine(models["target"], skip_tokenizer_init=True, show_progress=False, **spec, **kw)


def serve(eng, prompts, params, speculative=None, slots=2, sched=None, **kw):
    sched = sched or Scheduler(eng, max_running_requests=slots, **kw)
    res = {}
    for i, p in enumerate(prompts):
        r = Request(
            ids=p,
            params=SamplingParams.from_dict(params[i] if isinstance(params, list) else params),
            speculative=True if speculative is None else speculative[i],
            emit=lambda e, i=i: res.__setitem__(i, e["result"]) if e["type"] == "done" else None,
        )
        sched.submit(r)
    sched.run_until_idle()
    return [res[i] for i in range(len(prompts))], sched


@pytest.fixture(scope="module")
def reference(models):
    return [r["output_ids"] for r in engine(models).generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize(
    "algo,draft",
    [
        (None, None),
        ("EAGLE3", "eagle3"),
        pytest.param("NEXTN", "mtp", marks=pytest.mark.slow),  # the prefix-cache test below serves it too
        pytest.param("STANDALONE", "small", marks=pytest.mark.slow),
        pytest.param("NGRAM", None, marks=pytest.mark.slow),
    ],
)
def test_batched_greedy_identical_to_offline(models, reference, algo, draft):
    eng = engine(models, algo, draft)
    opt_out = [i % 2 == 1 for i in range(len(PROMPTS))]
    out, sched = serve(eng, PROMPTS, GREEDY, speculative=[not x for x in opt_out])
    for i, r in enumerate(out):
        assert r["output_ids"] == reference[i], i
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        if algo and not opt_out[i]:
            assert r["meta_info"]["speculative"] and r["meta_info"]["spec_verify_ct"] <= 24
            hist = r["meta_info"]["spec_accept_histogram"]
            assert sum(hist) == r["meta_info"]["spec_verify_ct"]
        else:
            assert r["meta_info"]["spec_verify_ct"] == 24
    assert sched.running == 0 and sched.queue_depth == 0


@pytest.mark.parametrize("algo,draft", [(None, None), ("EAGLE3", "eagle3")])
def test_pallas_backend_batched_greedy_identical_to_offline(models, reference, algo, draft):
    """The GPU's path, its kernels interpreted: fused layers, attention over the slots' whole KV
    buffers (not the view's slice), the round's KV commit kernel; the greedy outputs are the xla
    engine's."""
    eng = engine(models, algo, draft, attention_backend="pallas")
    out, _ = serve(eng, PROMPTS[:3], GREEDY)
    assert [r["output_ids"] for r in out] == reference[:3]


@pytest.mark.slow
@pytest.mark.parametrize("algo,draft", [(None, None), ("EAGLE3", "eagle3")])
def test_seeded_sampling_matches_offline(models, algo, draft):
    eng = engine(models, algo, draft)
    params = [dict(temperature=1.0, top_k=8, max_new_tokens=16, ignore_eos=True, seed=s) for s in range(len(PROMPTS))]
    ref = [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=params)]
    out, _ = serve(eng, PROMPTS, params, slots=3)
    assert [r["output_ids"] for r in out] == ref


def test_stops_and_max_new(models, reference):
    eng = engine(models, "EAGLE3", "eagle3")
    stop_tok = reference[1][5]
    params = [dict(GREEDY, max_new_tokens=1), dict(GREEDY, stop_token_ids=[stop_tok]), dict(GREEDY, max_new_tokens=0)]
    out, _ = serve(eng, PROMPTS[:3], params)
    assert out[0]["output_ids"] == reference[0][:1] and out[0]["meta_info"]["finish_reason"]["type"] == "length"
    cut = reference[1].index(stop_tok) + 1
    assert out[1]["output_ids"] == reference[1][:cut] and out[1]["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": stop_tok,
    }
    assert out[2]["output_ids"] == []


@pytest.mark.slow
def test_cancel_frees_slot_and_stops_device_work(models, reference):
    eng = engine(models, "EAGLE3", "eagle3")
    sched = Scheduler(eng, max_running_requests=2)
    events = []
    reqs = [
        Request(ids=p, params=SamplingParams.from_dict(dict(GREEDY, max_new_tokens=150)), emit=events.append)
        for p in PROMPTS[:2]
    ]
    for r in reqs:
        sched.submit(r)
    sched.step()
    sched.step()
    gone, stays = reqs
    sched.cancel(gone)
    assert sched.running == 1 and gone.slot not in sched.busy
    sched.step()  # this dispatch carries the kill
    sched.step()
    done = np.asarray(sched.batch.core.done)
    assert done[gone.slot] and not done[stays.slot]
    n_gone = len(gone.out_ids)
    sched.run_until_idle()
    assert len(gone.out_ids) == n_gone  # nothing more was delivered to the cancelled request
    assert stays.finished and not gone.finished
    assert [e["result"]["output_ids"] for e in events if e["type"] == "done"] == [stays.out_ids]
    other = {}
    r = Request(
        ids=PROMPTS[1],
        params=SamplingParams.from_dict(GREEDY),
        emit=lambda e: other.update(e) if e["type"] == "done" else None,
    )
    sched.submit(r)  # takes the freed slot
    sched.run_until_idle()
    assert r.slot == gone.slot and other["result"]["output_ids"] == reference[1]


@pytest.mark.slow
def test_long_prompt_spans_several_chunks(models):
    eng = engine(models, "EAGLE3", "eagle3", context_length=200)
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, V, 150)]
    ref = eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    out, _ = serve(eng, [prompt, PROMPTS[2]], GREEDY)
    assert out[0]["output_ids"] == ref


@pytest.mark.slow
@pytest.mark.parametrize("algo,draft", [(None, None), ("EAGLE3", "eagle3")])
def test_kv_span_grows_with_dispatches_in_flight(models, algo, draft):
    """Long outputs cross several KV-span buckets (64 -> 128 -> 256) while two dispatches are in
    flight (overlap, 6 rounds each): the span must cover both, or attention misses columns."""
    eng = engine(models, algo, draft)
    prompts = [list(range(1, 15)) * 3, [7, 8]]
    sp = dict(GREEDY, max_new_tokens=180)
    ref = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=sp)]
    out, sched = serve(eng, prompts, sp, decode_steps=6, overlap=True, min_span=64)
    assert [r["output_ids"] for r in out] == ref


@pytest.mark.slow
def test_long_prefill_interleaves_with_decoding(models):
    """A prompt of many chunks arriving while another request decodes is prefilled one chunk per
    dispatch (chunked prefill): the decoding request keeps streaming and finishes first; both
    outputs stay token-identical to the offline engine. A request cancelled mid-prefill keeps its
    slot until its prefill ends, so a newcomer never shares it."""
    eng = engine(models, "EAGLE3", "eagle3", context_length=200)  # chunked_prefill_size 4: 38 chunks
    long_prompt = [int(x) for x in np.random.default_rng(1).integers(0, V, 150)]
    ref = [r["output_ids"] for r in eng.generate(input_ids=[PROMPTS[1], long_prompt], sampling_params=GREEDY)]
    # no prefix cache: the long prompt comes twice, and the second must be prefilled chunk by chunk too
    sched = Scheduler(eng, max_running_requests=2, prefix_cache=False)
    order, res = [], {}

    def emit(name):
        def f(e):
            if e["type"] == "done":
                order.append(name)
                res[name] = e["result"]["output_ids"]

        return f

    short = Request(ids=PROMPTS[1], params=SamplingParams.from_dict(GREEDY), emit=emit("short"))
    sched.submit(short)
    sched.step()
    sched.step()
    sched.submit(Request(ids=long_prompt, params=SamplingParams.from_dict(GREEDY), emit=emit("long")))
    sched.run_until_idle()
    assert order == ["short", "long"] and res == {"short": ref[0], "long": ref[1]}

    keeper = Request(
        ids=PROMPTS[1], params=SamplingParams.from_dict(dict(GREEDY, max_new_tokens=120)), emit=emit("keeper")
    )
    sched.submit(keeper)
    sched.step()  # keeper decodes in slot 0
    doomed = Request(ids=long_prompt, params=SamplingParams.from_dict(GREEDY), emit=emit("doomed"))
    sched.submit(doomed)
    sched.step()  # doomed takes slot 1; one chunk of its prefill
    sched.cancel(doomed)
    assert doomed.slot in sched.busy  # reserved until its group's prefill is over
    late = Request(ids=PROMPTS[1], params=SamplingParams.from_dict(GREEDY), emit=emit("late"))
    sched.submit(late)
    sched.run_until_idle()
    assert "doomed" not in res and res["late"] == ref[0] and res["keeper"][:24] == ref[0]
    assert late.slot == doomed.slot  # it got the slot once the cancelled prefill let go


@pytest.mark.slow
def test_burst_admitted_a_prefill_budget_at_a_time(models, reference):
    """Requests arriving together while another decodes are prefilled up to --chunked-prefill-size
    prompt tokens per iteration (padding included), not one group per dispatch: with a budget of
    four 64-token chunks, three short prompts all get their first token in the same iteration
    (admitted as groups of two and one), and with a budget of one chunk only the first group does.
    Outputs stay token-identical."""
    for budget, started in [(256, 3), (64, 2)]:
        sched = Scheduler(engine(models, "EAGLE3", "eagle3", chunked_prefill_size=budget), max_running_requests=4)
        res = {}
        reqs = [
            Request(
                ids=PROMPTS[i],
                params=SamplingParams.from_dict(GREEDY),
                emit=lambda e, i=i, res=res: (
                    res.__setitem__(i, e["result"]["output_ids"]) if e["type"] == "done" else None
                ),
            )
            for i in range(4)
        ]
        sched.submit(reqs[0])
        sched.step()  # request 0 decodes
        for r in reqs[1:]:
            sched.submit(r)
        sched.step()
        assert sum(r.decoding for r in reqs[1:]) == started, budget
        sched.run_until_idle()
        assert res == {i: reference[i] for i in range(4)}


@pytest.mark.slow
def test_opted_out_sampling_matches_target_distribution(models):
    """Requests that turn speculation off on a speculative server sample inside the round
    (spec_round(plain=...)); their tokens 2 and 3 must follow the target distribution (chi-square)."""
    from helpers import chi2_pvalue, exact_pair_distribution

    prompt, n = [3, 1, 4], 4096
    probs = exact_pair_distribution(models["hf"], prompt, 1.0)
    eng = engine(models, "EAGLE3", "eagle3")
    params = [dict(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    out, _ = serve(eng, [prompt] * n, params, speculative=[False] * n, slots=512, max_queued_requests=n)
    counts = np.zeros((V, V))
    for r in out:
        assert not r["meta_info"]["speculative"]
        counts[r["output_ids"][1], r["output_ids"][2]] += 1
    assert chi2_pvalue(counts, probs) > 1e-3


A = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3]
B = [2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
# each step's prompts are submitted together and run until idle; a function builds a prompt from
# the outputs so far (a second turn: the first turn's prompt and answer, then a new message)
SCRIPT = [
    [A],
    [B],
    [lambda out: A + out[0] + [7, 7]],
    [lambda out: B + out[1][:8] + [8]],
    [SHARED + [j + 1, 2] for j in range(4)],
]


def run_script(sched, script=SCRIPT):
    """The results of `script`'s requests, in order."""
    res: list[dict] = []
    for step in script:
        start = len(res)
        res += [{}] * len(step)
        for j, p in enumerate(step):
            sched.submit(
                Request(
                    ids=p([r["output_ids"] for r in res[:start]]) if callable(p) else p,
                    params=SamplingParams.from_dict(dict(GREEDY, max_new_tokens=12)),
                    emit=lambda e, i=start + j, res=res: (
                        res.__setitem__(i, e["result"]) if e["type"] == "done" else None
                    ),
                )
            )
        sched.run_until_idle()
    return res


@pytest.mark.parametrize(
    "algo,draft",
    [
        (None, None),
        pytest.param("EAGLE3", "eagle3", marks=pytest.mark.slow),
        ("NEXTN", "mtp"),
        pytest.param("NGRAM", None, marks=pytest.mark.slow),
    ],
)
def test_prefix_cache_identical_outputs_less_prefill(models, algo, draft):
    """Prefix caching against the same requests with the cache off: second turns of two
    conversations taking turns (the first conversation's slot is taken by the second's first turn,
    so its cache is moved to another free slot, not dropped) and four concurrent requests sharing a
    prefix (the first prefills it, the others wait for it and copy its KV). Outputs and the number
    of verification rounds are identical (the draft's cache is reused as well as the target's);
    the cached tokens are what the prefixes allow; prefill does less work."""
    runs = {}
    for cache in (True, False):  # an engine each: NGRAM's corpus learns from every request
        sched = Scheduler(engine(models, algo, draft), max_running_requests=4, prefix_cache=cache)
        sched.cache.min_reuse = 4
        runs[cache] = (run_script(sched), sched.stats)
    (on, st_on), (off, st_off) = runs[True], runs[False]
    assert [r["output_ids"] for r in on] == [r["output_ids"] for r in off]
    if algo != "NGRAM":  # NGRAM's rounds depend on which requests finished first (its corpus learns from them)
        assert [r["meta_info"]["spec_verify_ct"] for r in on] == [r["meta_info"]["spec_verify_ct"] for r in off]
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in off)
    cached = [r["meta_info"]["cached_tokens"] for r in on]
    shift = 1 if algo in ("EAGLE3", "NEXTN") else 0
    # a second turn reuses its first turn's prompt and answer but the last two tokens (B's second
    # turn keeps only 8 of 12), the requests sharing a prefix all of it; all but the draft's shift
    assert cached[2:4] == [len(A) + 12 - 2 - shift, len(B) + 8 - shift], cached
    assert cached[:2] == [0, 0] and cached[4] == 0
    assert cached[5:] == [len(SHARED) - shift] * 3, cached
    assert st_on.cached_tokens == sum(cached) and st_off.cached_tokens == 0
    assert st_on.prefill_tokens + st_on.cached_tokens == st_off.prefill_tokens
    assert st_on.prefill_tokens < 0.6 * st_off.prefill_tokens


@pytest.mark.slow
def test_prefix_cache_survives_exercise_and_flush(models):
    """A program run on free slots (a fresh background compile's first run) cuts the cached
    prefixes of the slots it overwrites; /flush_cache forgets them all; a request in a slot whose
    cache was cut is still served correctly."""
    eng = engine(models, "EAGLE3", "eagle3")
    sched = Scheduler(eng, max_running_requests=2)
    sched.cache.min_reuse = 4
    first = run_script(sched, SCRIPT[:1])
    assert set(sched.cache.held) == {0} and len(sched.cache.held[0]) == len(A) + 12 - 2
    sched.forget([0], 6)
    assert len(sched.cache.held[0]) == 5
    again = run_script(sched, [[A]])
    assert again[0]["output_ids"] == first[0]["output_ids"] and again[0]["meta_info"]["cached_tokens"] <= 4
    assert sched.flush_cache() == 1 and not sched.cache.held
    third = run_script(sched, [[A]])
    assert third[0]["output_ids"] == first[0]["output_ids"] and third[0]["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("online", [False, True])
def test_one_request_dispatch_writes_the_cache_in_place(models, online):
    """A dispatch for one request writes one KV column per step and layer. XLA rewrites a one-element
    scatter into a dynamic-update-slice, which inside the step loop copied every layer's whole cache
    (target and draft) at every step: tens of MB per round at a real context length. KVCache.write
    keeps the update a scatter; the compiled programs hold no copy of a cache buffer. With online
    draft training the draft cache also keeps the target's features: stored as bfloat16 they were
    converted to float32 and back, whole, at every write (XLA:CPU has no bfloat16 scatter); no
    buffer of a cache's shape is copied or converted."""
    eng = Engine(
        models["target"], skip_tokenizer_init=True, show_progress=False, speculative_algorithm="EAGLE3",
        speculative_draft_model_path=models["eagle3"], speculative_num_steps=2, speculative_eagle_topk=1,
        speculative_num_draft_tokens=3, speculative_adaptive=True, speculative_online_train=online,
    )  # fmt: skip
    sched = Scheduler(eng, max_running_requests=2)
    assert "off" in sched.shapes
    caches = [sched.batch.core.cache, sched.batch.core.draft.cache]
    assert len(caches[1].k) == 1 + online
    dims = {"[" + ",".join(map(str, x.shape)) + "]" for c in caches for x in c.k}
    op = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+(\[[\d,]*\])\S* (\w[\w-]*)\(")
    span = sched.programs.spans()[0]
    for shape in sched.shapes:  # the tree shape(s) and "off" (plain steps) under adaptive speculation
        key = ("dispatch", 1, span, True, shape, False, False)
        hlo = sched.programs._lower(key).compile().as_text()
        found = [m.groups() for m in map(op.match, hlo.splitlines()) if m and m.group(2) in dims]
        assert any(code == "scatter" for _, _, code in found)  # (the pattern reads these programs)
        whole = [f for f in found if f[2] == "copy" or "convert" in f[0] or f[2] == "convert"]
        assert not whole, (key, whole[:2])
    if online:
        eng.online.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise")
def test_release_columns_frees_one_slots_tail_only():
    """A free slot's columns past its cached prefix go back to the kernel (they read as zeros);
    its prefix and every other slot keep their contents."""
    col = 3 * 64 * 4  # bytes per column (not a divisor of the page: pages straddle columns)
    per_page = -(-os.sysconf("SC_PAGE_SIZE") // col)
    x = (jnp.ones((4, 100 * per_page, 3, 64), jnp.float32) + 0).block_until_ready()  # written
    released = release_columns([x], 1, 10)
    a = np.asarray(x)
    assert released >= (100 * per_page - 10 - 2 * per_page) * col and (a == 0).sum() * 4 == released
    assert (a[[0, 2, 3]] == 1).all() and (a[1, :10] == 1).all()
    assert (a[1, 10 + per_page : -per_page] == 0).all()
    assert release_columns([x], 9, 0) == 0 and release_columns([x], 1, 10**6) == 0  # nothing there


def test_finished_slots_tails_are_released(models, reference):
    """After a request finishes, its slot's columns past the prefix it keeps are handed back (the
    scheduler's release_tails), and a request reusing that prefix is still served exactly."""
    eng = engine(models)
    sched = Scheduler(eng, max_running_requests=2)
    c = sched.batch.core.cache  # as if an earlier, longer request had written every column
    ones = lambda t: tuple(jnp.ones_like(a) for a in t)
    sched.batch.core.cache = dataclasses.replace(c, k=ones(c.k), v=ones(c.v))
    out, _ = serve(eng, PROMPTS[1:2], GREEDY, sched=sched)
    slot = next(iter(sched.cache.held))
    kept = sched.cache.held_length(slot)
    k = np.asarray(sched.batch.core.cache.k[0])
    per_page = os.sysconf("SC_PAGE_SIZE") // (k.shape[2] * k.shape[3] * 4)
    assert kept > 0 and (k[slot, kept + 2 * per_page : -per_page] == 0).all() and (k[1 - slot] == 1).all()
    again, _ = serve(eng, PROMPTS[1:2], GREEDY, sched=sched)
    assert out[0]["output_ids"] == again[0]["output_ids"] == reference[1]


def test_cached_tail_prefilled_by_a_small_chunk_from_earlier(models, monkeypatch):
    """A prompt whose KV is cached but for its last token: when the smallest chunk is compiled only
    at the shortest span, and from the cached position it would need a longer one, the plan
    recomputes a few cached positions in that small chunk rather than running the largest chunk
    over the longest span (1.2 s against 0.12 s for SmolLM2 on the 2-core CPU)."""
    sched = Scheduler(engine(models, chunked_prefill_size=256), max_running_requests=2)
    progs = sched.programs
    spans, sizes = progs.spans(), progs.chunk_sizes()
    assert len(spans) > 1 and len(sizes) > 1
    small, large = ("chunk", 1, sizes[0], spans[0]), ("chunk", 1, sizes[-1], spans[-1])
    monkeypatch.setattr(progs, "_have", lambda: [small, large])
    monkeypatch.setattr(progs, "lazy", False)
    length = spans[0] - 1
    assert progs.prefill_plan(1, length, start=0) == (sizes[0], 0, [small])  # as before: from the start
    c, first, keys = progs.prefill_plan(1, length, start=length - 1)
    assert keys == [small] and c == sizes[0] and first == spans[0] - sizes[0] < length - 1
    # a prompt past the short span: the large chunk is all there is
    assert progs.prefill_plan(1, spans[0] + 10, start=spans[0] + 9)[2] == [large]


def test_a_prefill_through_other_chunks_asks_for_its_own(models, monkeypatch):
    """A cached prompt's tail that no compiled chunk serves from its cached position (it is
    recomputed from an earlier one through the large chunk) asks the background for its own small
    chunk at its span; a prompt the compiled chunks serve exactly asks for nothing."""
    sched = Scheduler(engine(models, chunked_prefill_size=256), max_running_requests=2)
    progs = sched.programs
    spans, sizes = progs.spans(), progs.chunk_sizes()
    small, large = ("chunk", 1, sizes[0], spans[0]), ("chunk", 1, sizes[-1], spans[-1])
    monkeypatch.setattr(progs, "_have", lambda: [small, large])
    monkeypatch.setattr(progs, "lazy", False)
    asked: list[tuple] = []
    monkeypatch.setattr(progs, "want", asked.append)
    request = lambda n: Request(ids=list(range(1, n + 1)), params=SamplingParams(**GREEDY), emit=lambda e: None)
    tail = request(spans[0] + 10)
    tail._reuse = spans[0] + 9
    group = sched._new_group([tail])
    assert group.keys == [large] and group.start < tail._reuse
    assert asked == [("chunk", 1, sizes[0], sched._span(tail._reuse + sizes[0]))] != [small]
    asked.clear()
    assert sched._new_group([request(spans[0] - 1)]).keys == [small] and asked == []

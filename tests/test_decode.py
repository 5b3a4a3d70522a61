"""The compiled while_loop decode equals a sequential one-token-at-a-time reference decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams, SamplingTensors, sample

from helpers import tiny_model


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, params, tok, pos, cache):
    """One token through the model (jitted only to keep the test fast)."""
    model = nnx.merge(graphdef, params)
    h, cache, _ = model(tok, pos, cache)
    return model.logits(h[:, 0]), cache


def reference_decode(model, prompt, p: SamplingParams, seed, eos=(2,)):
    """Batch-1, token-by-token: no chunked prefill, no while_loop, no padding."""
    graphdef, params = nnx.split(model)
    v = model.cfg.vocab_size
    cache = KVCache.create(model.cfg, 1, len(prompt) + p.max_new_tokens + 1, jnp.float32)
    st = SamplingTensors.build([p], [seed])
    stop = set(() if p.ignore_eos else eos) | set(p.stop_token_ids or [])
    counts = np.zeros((1, v), np.int32)
    seen = np.zeros((1, v), bool)
    seen[0, prompt] = True
    out = []
    tokens = list(prompt)
    fed = 0
    while len(out) < p.max_new_tokens:
        while fed < len(tokens):  # feed every token without KV yet, one at a time
            logits, cache = _step(graphdef, params, jnp.asarray([[tokens[fed]]]), jnp.asarray([[fed]]), cache)
            cache.lengths = cache.lengths + 1
            fed += 1
        keys = jax.vmap(jax.random.fold_in)(st.keys, jnp.asarray([len(out)]))
        tok = int(jax.jit(sample)(logits, st, jnp.asarray(counts), jnp.asarray(seen), keys)[0])
        out.append(tok)
        counts[0, tok] += 1
        seen[0, tok] = True
        tokens.append(tok)
        if tok in stop:
            break
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)[0]


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [4], [20, 30, 40, 50, 60, 70]]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        dict(temperature=0.0, max_new_tokens=20),
        dict(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=12, ignore_eos=True),
        dict(
            temperature=1.0,
            min_p=0.05,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            max_new_tokens=12,
        ),
    ],
    ids=["greedy", "greedy_eos", "topk_topp", "penalties_minp"],
)
def test_while_loop_matches_sequential(model, params):
    eng = Engine.from_model(model, chunked_prefill_size=4)  # forces several prefill chunks
    seeds = [11, 22, 33, 44]
    sps = [dict(params, seed=s) for s in seeds]
    got = eng.generate(input_ids=PROMPTS, sampling_params=sps)
    for prompt, s, g in zip(PROMPTS, seeds, got):
        ref = reference_decode(model, prompt, SamplingParams.from_dict(dict(params, seed=s)), s)
        assert g["output_ids"] == ref
        assert g["meta_info"]["completion_tokens"] == len(ref)
        assert g["meta_info"]["prompt_tokens"] == len(prompt)


def test_stop_conditions(model):
    eng = Engine.from_model(model)
    free = eng.generate(input_ids=[5, 6, 7], sampling_params=dict(temperature=0, max_new_tokens=10, ignore_eos=True))
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    stop_tok = free["output_ids"][3]
    first = free["output_ids"].index(stop_tok)
    r = eng.generate(
        input_ids=[5, 6, 7],
        sampling_params=dict(temperature=0, max_new_tokens=10, stop_token_ids=[stop_tok], ignore_eos=True),
    )
    assert r["output_ids"] == free["output_ids"][: first + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    z = eng.generate(input_ids=[5, 6, 7], sampling_params=dict(max_new_tokens=0))
    assert z["output_ids"] == [] and z["meta_info"]["finish_reason"]["type"] == "length"


def test_seeded_sampling_reproducible_and_batch_independent(model):
    eng = Engine.from_model(model)
    sp = dict(temperature=1.0, max_new_tokens=16, seed=7, ignore_eos=True)
    a = eng.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]
    b = eng.generate(input_ids=[[1, 2], [5, 6, 7], [3]], sampling_params=sp)[1]["output_ids"]
    c = eng.generate(input_ids=[5, 6, 7], sampling_params=dict(sp, seed=8))["output_ids"]
    assert a == b
    assert a != c


def test_batches_larger_than_max_running_requests(model):
    eng = Engine.from_model(model, max_running_requests=2)
    sp = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
    many = eng.generate(input_ids=PROMPTS, sampling_params=sp)
    alone = [eng.generate(input_ids=p, sampling_params=sp) for p in PROMPTS]
    assert [m["output_ids"] for m in many] == [a["output_ids"] for a in alone]


def test_context_length_clips_output(model):
    eng = Engine.from_model(model, context_length=10)
    r = eng.generate(input_ids=[5, 6, 7, 8], sampling_params=dict(temperature=0, max_new_tokens=50, ignore_eos=True))
    assert len(r["output_ids"]) == 6

"""Multi-layer MTP (--enable-multi-layer-eagle): checkpoints with several MTP modules, module j
drafting the j-th token after the root. Lossless against plain decoding; the incremental draft
(prefill in chunks, extends with partly-used blocks, the chain) against a from-scratch
computation of every module over the whole sequence."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.speculative.proposers.base import DraftState

from helpers import add_mtp_modules, chi2_pvalue, exact_pair_distribution, make_hf_model, sample_pairs

V = 16
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4], [4]]
GREEDY = dict(temperature=0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """llama + 3 NextN modules (layers 3, 4, 5), qwen2 + 2 MiMo modules, and the plain targets."""
    d = tmp_path_factory.mktemp("mtp_multi")
    out = {}
    for fam, kind, count in (("llama", "NEXTN", 3), ("qwen2", "MIMO", 2)):
        hf = make_hf_model(fam, 3, vocab_size=V, num_hidden_layers=3, initializer_range=0.3)
        base = d / f"{fam}-plain"
        hf.save_pretrained(base)
        path = d / f"{fam}-{kind}"
        shutil.copytree(base, path)
        add_mtp_modules(path, kind, count, seed=7)
        out[f"{fam}-{kind}"] = str(path)
        out[f"{fam}-plain"] = str(base)
        out[f"hf-{fam}"] = hf
    return out


def engine(path, **kw):
    return Engine(path, skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=4, **kw)


def multi(steps: int, **kw):
    return dict(
        speculative_algorithm="NEXTN",
        enable_multi_layer_eagle=True,
        speculative_num_steps=steps,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=steps + 1,
        **kw,
    )


@pytest.mark.parametrize("name,steps", [("llama-NEXTN", 3), ("llama-NEXTN", 2), ("qwen2-MIMO", 2)])
def test_multi_layer_mtp_is_lossless(models, name, steps):
    fam = name.split("-")[0]
    plain = engine(models[f"{fam}-plain"]).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    eng = engine(models[name], **multi(steps))
    assert eng.proposer is not None and eng.proposer.num_modules == steps
    out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in plain]
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in out)
    assert rounds < sum(len(r["output_ids"]) for r in out) - len(out)  # some drafts were accepted


def test_multi_layer_mtp_with_adaptive_speculation_is_lossless(models):
    plain = engine(models["llama-plain"]).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    out = engine(models["llama-NEXTN"], **multi(3, speculative_adaptive=True)).generate(
        input_ids=PROMPTS, sampling_params=GREEDY
    )
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in plain]


@pytest.mark.slow
def test_multi_layer_mtp_sampling_matches_target_distribution(models):
    prompt, temp, n = [3, 1, 4], 1.0, 4096
    probs = exact_pair_distribution(models["hf-llama"], prompt, temp)
    eng = engine(models["llama-NEXTN"], max_running_requests=512, **multi(3))
    assert chi2_pvalue(sample_pairs(eng, prompt, n, temp), probs) > 1e-3


def _reference_chain(tgt, heads, seq, chain_len):
    """From scratch: every module over positions 0 .. L-1 of `seq` (x_0 .. x_L, L = len - 1) with a
    fresh cache and causal attention, module j reading x_{p+j} (drafted tokens past x_L, argmax of
    the previous module's distribution) and module j-1's outputs. -> (drafts, their distributions)."""
    ll = len(seq) - 1
    toks = jnp.asarray(seq[:-1])[None]
    h, _, _ = tgt(toks, jnp.arange(ll)[None], KVCache.create(tgt.cfg, 1, ll + 8, jnp.float32))
    x = list(seq)
    drafts, dists = [], []
    for j in range(1, chain_len + 1):
        t = jnp.asarray(x[j : ll + j])[None]
        cache = KVCache.create(heads[j - 1].cfg, 1, ll + 8, jnp.float32)
        h, _, _ = heads[j - 1](tgt.embed_tokens[...][t], h, jnp.arange(ll)[None], cache)
        p = np.asarray(jax.nn.softmax(tgt.logits(h[0, -1]), -1))
        dists.append(p)
        drafts.append(int(np.argmax(p)))
        x.append(drafts[-1])
    return drafts, dists


@pytest.mark.parametrize("prompt_len", [1, 2, 7])
def test_incremental_draft_matches_the_modules_run_from_scratch(models, prompt_len):
    """Prefill in chunks of 3, one extend with the first token, one with a block of 3 of which 2
    are real (the third is padding), then the chain of 3: each step's distribution equals every
    module run over the whole sequence from scratch (module j trails module 1 by j - 1 entries and
    reads module j-1's outputs; short prompts leave the trailing modules no committed entry)."""
    eng = engine(models["llama-NEXTN"], **multi(3))
    prop, dparams = eng.proposer, eng.dparams
    tgt = nnx.merge(eng.graphdef, eng.params)
    rng = np.random.default_rng(prompt_len)
    seq = [int(t) for t in rng.integers(0, V, prompt_len + 3)]  # x_0 .. x_{P+2}
    p = prompt_len
    full = jnp.asarray(seq)[None]
    h, _, _ = tgt(full, jnp.arange(len(seq))[None], KVCache.create(tgt.cfg, 1, 32, jnp.float32))

    cache = prop.make_cache(1, 32, jnp.float32)
    chunk = 3
    for start in range(0, max(p - 1, 1), chunk):  # draft prefill: entries 0 .. P-2 (x_{q+1}, h_q)
        idx = np.arange(start, start + chunk)
        dt = jnp.asarray([[seq[i + 1] if i + 1 < p else 0 for i in idx]])
        ft = h[:, np.minimum(idx, len(seq) - 1)]
        cache = prop.prefill_chunk(dparams, tgt, cache, dt, ft, start, jnp.asarray([p - 1]))
    assert int(cache.lengths[0]) == p - 1
    state = DraftState(cache, jnp.zeros((1, V)), jnp.zeros((1, tgt.cfg.hidden_size)))
    one = jnp.ones((1,), bool)
    state = prop.extend(dparams, tgt, state, jnp.asarray([[seq[p]]]), h[:, p - 1 : p], jnp.asarray([1]), one)
    block = jnp.asarray([[seq[p + 1], seq[p + 2], 0]])
    state = prop.extend(dparams, tgt, state, block, h[:, p : p + 3], jnp.asarray([2]), one)
    assert int(state.cache.lengths[0]) == p + 2

    heads = nnx.merge(prop.graphdef, dparams["draft"]).heads
    want_drafts, want = _reference_chain(tgt, heads, seq, 3)
    got = [np.asarray(state.root_probs[0])]
    tok, hidden = jnp.asarray([[want_drafts[0]]]), state.root_hidden[:, None]
    for depth in (1, 2):
        probs, hidden, state = prop.step(dparams, tgt, state, tok, hidden, depth, None, 0)
        got.append(np.asarray(probs[0, 0]))
        tok = jnp.asarray([[want_drafts[depth]]])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


def test_multi_layer_errors(models):
    with pytest.raises(JaxspecError, match="asks for more than the 3 MTP layer"):
        engine(models["llama-NEXTN"], **multi(4))
    with pytest.raises(JaxspecError, match="speculative-eagle-topk 1"):
        engine(
            models["llama-NEXTN"],
            speculative_algorithm="NEXTN",
            enable_multi_layer_eagle=True,
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=6,
        )
    with pytest.raises(JaxspecError, match="has none"):
        engine(models["llama-plain"], **multi(2, speculative_draft_model_path=models["llama-plain"]))


def test_without_the_flag_the_first_module_drafts_every_step(models):
    eng = engine(models["llama-NEXTN"], speculative_algorithm="NEXTN")
    assert type(eng.proposer).__name__ == "EagleProposer"
    # defaults without the flag: the Llama tree; with it: a chain of 3
    assert (eng.spec.num_steps, eng.spec.eagle_topk) == (5, 4)
    eng = engine(models["llama-NEXTN"], speculative_algorithm="NEXTN", enable_multi_layer_eagle=True)
    assert (eng.spec.num_steps, eng.spec.eagle_topk, eng.spec.num_draft_tokens) == (3, 1, 4)

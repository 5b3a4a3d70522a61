"""Speculative decoding end to end on tiny random models.

Temperature 0: token-identical to plain greedy decoding for STANDALONE, EAGLE and EAGLE3, chains and
trees, batch 1 and batch 4 with mixed prompt lengths. Temperature > 0: the emitted tokens follow
the target distribution (chi-square), and thresholds < 1 are detected as biased.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from jaxspec.errors import JaxspecError

from helpers import (  # noqa: F401 - models and plain are fixtures
    GREEDY,
    PROMPTS,
    V,
    chi2_pvalue,
    engine,
    exact_pair_distribution,
    make_hf_model,
    models,
    plain,
    sample_pairs,
)

CASES = [
    ("STANDALONE", "small", (3, 1, 4)),
    ("STANDALONE", "small", (3, 2, 6)),
    ("STANDALONE", "small", (4, 4, 8)),
    ("STANDALONE", "small", (3, 8, 16)),
    ("EAGLE", "eagle", (3, 1, 4)),
    ("EAGLE", "eagle", (5, 4, 8)),
    ("EAGLE3", "eagle3", (3, 1, 4)),
    ("EAGLE3", "eagle3", (4, 2, 6)),
    ("EAGLE3", "eagle3", (3, 8, 12)),
]
# make test runs one chain and a few trees of each kind; make test-all runs them all
SLOW_CASES = {
    ("STANDALONE", (3, 1, 4)),
    ("STANDALONE", (4, 4, 8)),
    ("STANDALONE", (3, 8, 16)),
    ("EAGLE", (3, 1, 4)),
    ("EAGLE3", (4, 2, 6)),
}
PARAMS = [
    pytest.param(a, d, k, id=f"{a}-{k[0]}-{k[1]}-{k[2]}", marks=[pytest.mark.slow] if (a, k) in SLOW_CASES else [])
    for a, d, k in CASES
]


@pytest.mark.parametrize("algo,draft,knobs", PARAMS)
def test_greedy_identical_to_plain(models, plain, algo, draft, knobs):  # noqa: F811
    eng = engine(models, algo, draft, knobs)
    out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for p, r in zip(PROMPTS, out):
        assert r["output_ids"] == plain[len(p)]
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in out)
    emitted = sum(sum(i * c for i, c in enumerate(r["meta_info"]["spec_accept_histogram"], 1)) for r in out)
    assert emitted >= sum(len(r["output_ids"]) for r in out) - len(out)  # histogram covers every round's tokens
    assert rounds < sum(len(r["output_ids"]) for r in out) - len(out)  # some draft tokens were accepted
    single = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)  # batch 1
    assert single["output_ids"] == plain[len(PROMPTS[1])]


@pytest.mark.parametrize(
    "target,knobs", [("target", (4, 1, 5)), pytest.param("sharp", (4, 2, 8), marks=pytest.mark.slow)]
)
def test_target_as_its_own_draft_accepts_everything(models, target, knobs):  # noqa: F811
    """The engine's ceiling: every draft token is accepted, so each round emits num_steps + 1.

    For a tree this holds only when the draft's greedy chain survives the rerank to N - 1 nodes,
    i.e. when its path scores beat the side branches: true for a sharp target (test), not in
    general (a flat target's second-best depth-1 child can outscore the chain's deep nodes)."""
    steps = knobs[0]
    # the draft unquantized, i.e. the target itself (on CPU a draft runs in int8 by default)
    eng = engine(models, "STANDALONE", target, knobs, target=target, speculative_draft_model_quantization="unquant")
    out = eng.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=1 + 5 * (steps + 1)))
    for r in out:
        hist = r["meta_info"]["spec_accept_histogram"]
        assert hist == [0] * steps + [5]
        assert r["meta_info"]["spec_accept_length"] == pytest.approx(26 / 5)


def test_metrics_and_stops(models, plain):  # noqa: F811
    eng = engine(models, "EAGLE3", "eagle3", (3, 2, 6))
    ref = plain[len(PROMPTS[0])]
    stop = ref[5]
    r = eng.generate(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, stop_token_ids=[stop]))
    assert r["output_ids"] == ref[: ref.index(stop) + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    m = eng.generate(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, max_new_tokens=7))["meta_info"]
    assert m["completion_tokens"] == 7 and m["finish_reason"] == {"type": "length", "length": 7}
    assert m["spec_accept_length"] == pytest.approx(7 / m["spec_verify_ct"])
    assert len(m["spec_accept_histogram"]) == 4


def test_token_map(models, plain, tmp_path, caplog):  # noqa: F811
    ids = sorted(set(range(0, V, 2)) | {1})
    (tmp_path / "map.txt").write_text(" ".join(map(str, ids)))
    np.save(tmp_path / "map.npy", np.asarray(ids))
    torch.save(ids, tmp_path / "map.pt")
    for algo, draft, fname in [
        ("STANDALONE", "small", "map.txt"),
        ("EAGLE", "eagle", "map.npy"),
        ("EAGLE", "eagle", "map.pt"),
    ]:
        eng = engine(models, algo, draft, (3, 2, 6), speculative_token_map=str(tmp_path / fname))
        assert eng.proposer.draft_vocab == len(ids)
        out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in out] == [plain[len(p)] for p in PROMPTS]
    with caplog.at_level(logging.WARNING, logger="jaxspec"):
        engine(models, "EAGLE3", "eagle3", (3, 2, 6), speculative_token_map=str(tmp_path / "map.txt"))
    assert "ignored for EAGLE3" in caplog.text


def test_draft_errors(models, tmp_path):  # noqa: F811
    make_hf_model("llama", 5, vocab_size=V + 3, num_hidden_layers=1).save_pretrained(tmp_path / "other")
    models = dict(models, other=str(tmp_path / "other"))
    with pytest.raises(JaxspecError, match="vocab_size"):
        engine(models, "STANDALONE", "other")
    with pytest.raises(JaxspecError, match="LlamaForCausalLMEagle3"):
        engine(models, "EAGLE3", "eagle")
    with pytest.raises(JaxspecError, match="penalties"):
        engine(models, "EAGLE", "eagle").generate(input_ids=[1, 2], sampling_params={"repetition_penalty": 1.2})


@pytest.mark.parametrize(
    "algo,draft", [pytest.param("STANDALONE", "small", marks=pytest.mark.slow), ("EAGLE3", "eagle3")]
)
def test_sampling_matches_target_distribution(models, algo, draft):  # noqa: F811
    prompt, temp, n = [3, 1, 4], 1.0, 4096
    probs = exact_pair_distribution(models["hf"], prompt, temp)
    eng = engine(models, algo, draft, (3, 2, 6), max_running_requests=512)
    counts = sample_pairs(eng, prompt, n, temp)
    assert chi2_pvalue(counts, probs) > 1e-3
    # the same test rejects a sampler that accepts too eagerly (thresholds < 1 are lossy)
    lossy = engine(
        models,
        algo,
        draft,
        (3, 2, 6),
        max_running_requests=512,
        speculative_accept_threshold_single=0.05,
        speculative_accept_threshold_acc=0.3,
    )
    assert chi2_pvalue(sample_pairs(lossy, prompt, n, temp), probs) < 1e-3


def test_convert_eagle_bin_checkpoint(models, plain, tmp_path):  # noqa: F811
    """An EAGLE-3 head shipped as pytorch_model.bin converts to safetensors and loads the same."""
    import shutil

    from safetensors.numpy import load_file

    from jaxspec.convert.checkpoint import convert

    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy(f"{models['eagle3']}/config.json", src)
    torch.save(
        {k: torch.from_numpy(v) for k, v in load_file(f"{models['eagle3']}/model.safetensors").items()},
        src / "pytorch_model.bin",
    )
    out = convert(str(src), str(tmp_path / "out"), progress=False)
    models = dict(models, converted=out)
    eng = engine(models, "EAGLE3", "converted", (3, 2, 6))
    assert [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == [
        plain[len(p)] for p in PROMPTS
    ]


@pytest.mark.parametrize(
    "algo,draft,knobs",
    [("EAGLE3", "eagle3", (3, 8, 12)), pytest.param("STANDALONE", "small", (3, 2, 6), marks=pytest.mark.slow)],
)
def test_round_has_no_vocab_sort_and_no_branch(models, monkeypatch, algo, draft, knobs):  # noqa: F811
    """The compiled speculative program of a sampled batch (every filter on), traced as for a GPU,
    holds no sort over the vocabulary and no conditional: its while loop runs straight-line rounds."""
    from test_sampling import assert_no_vocab_sort_or_branch

    import jaxspec.engine as engine_module

    from helpers import straight_line_sampler

    straight_line_sampler(monkeypatch)

    real, hlo = engine_module.spec_run, []

    def spy(*args, **kwargs):
        hlo.append(real.lower(*args, **kwargs).compile().as_text())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "spec_run", spy)
    eng = engine(models, algo, draft, knobs)
    sp = [dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, max_new_tokens=4), dict(temperature=0.0)]
    eng.generate(input_ids=PROMPTS[:2], sampling_params=sp)
    assert len(hlo) == 1 and " while(" in hlo[0]
    assert_no_vocab_sort_or_branch(hlo[0], V)

"""Logprobs and n > 1 in the offline engine: the target's log-softmax (HF transformers as the
reference) for generated and prompt tokens, the same with and without speculation."""

import numpy as np
import pytest
import torch

from helpers import GREEDY, PROMPTS, engine, models  # noqa: F401  (models is a fixture)


def hf_logprobs(hf, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    """[len(ids), V]: log_softmax(logits / T) at every position of ids (row i predicts ids[i + 1])."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits / temperature, -1).numpy()


def out_logprobs(res) -> tuple[list[float], list[list[tuple[float, int]]]]:
    m = res["meta_info"]
    assert [e[1] for e in m["output_token_logprobs"]] == res["output_ids"]
    return [e[0] for e in m["output_token_logprobs"]], [[(x[0], x[1]) for x in row] for row in m["output_top_logprobs"]]


def check_against_hf(hf, prompt, res, temperature, top_n):
    ref = hf_logprobs(hf, prompt + res["output_ids"], temperature)
    lps, tops = out_logprobs(res)
    for i, (t, lp, top) in enumerate(zip(res["output_ids"], lps, tops)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp - row[t]) < 1e-4, (i, lp, row[t])
        assert len(top) == top_n
        want = np.sort(row)[::-1][:top_n]
        np.testing.assert_allclose([x[0] for x in top], want, atol=1e-4)
        for lp_k, tok_k in top:
            assert abs(row[tok_k] - lp_k) < 1e-4


@pytest.mark.parametrize("algo", [None, "EAGLE", "EAGLE3"])
def test_greedy_logprobs_match_hf(models, algo):  # noqa: F811
    """Tokens accepted from drafts and from plain steps get the target's own logprobs."""
    draft = {"EAGLE": "eagle", "EAGLE3": "eagle3"}.get(algo)
    eng = engine(models, algo, draft, knobs=(3, 2, 5) if algo else None)
    res = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3)
    for p, r in zip(PROMPTS, res):
        check_against_hf(models["hf"], p, r, 1.0, 3)
        _, tops = out_logprobs(r)
        assert all(top[0][1] == t for top, t in zip(tops, r["output_ids"]))  # greedy: the argmax
    if algo:
        assert sum(r["meta_info"]["spec_verify_ct"] for r in res) < sum(len(r["output_ids"]) for r in res)


@pytest.mark.slow
def test_sampled_logprobs_use_the_temperature(models):  # noqa: F811
    eng = engine(models, "EAGLE", "eagle", knobs=(3, 2, 5))
    params = dict(temperature=0.7, max_new_tokens=16, ignore_eos=True, seed=3)
    res = eng.generate(input_ids=PROMPTS[:2], sampling_params=params, return_logprob=True, top_logprobs_num=2)
    for p, r in zip(PROMPTS, res):
        check_against_hf(models["hf"], p, r, 0.7, 2)


def test_prompt_logprobs(models):  # noqa: F811
    eng = engine(models)
    prompt = PROMPTS[1]
    res = eng.generate(
        input_ids=prompt,
        sampling_params=dict(GREEDY, max_new_tokens=2),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=1,
    )
    m = res["meta_info"]
    ref = hf_logprobs(models["hf"], prompt)
    assert [e[1] for e in m["input_token_logprobs"]] == prompt
    assert m["input_token_logprobs"][0][0] is None and m["input_top_logprobs"][0] is None
    for i in range(1, len(prompt)):
        assert abs(m["input_token_logprobs"][i][0] - ref[i - 1][prompt[i]]) < 1e-4
        assert m["input_top_logprobs"][i][0][1] == int(np.argmax(ref[i - 1]))
    later = eng.generate(
        input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=2), return_logprob=True, logprob_start_len=4
    )
    assert later["meta_info"]["input_token_logprobs"] == [[e[0], e[1], None] for e in m["input_token_logprobs"][4:]]


def test_logprob_arguments_are_checked(models):  # noqa: F811
    from jaxspec.errors import JaxspecError

    eng = engine(models)
    with pytest.raises(JaxspecError, match="top_logprobs_num"):
        eng.generate(input_ids=[1, 2], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=21)
    res = eng.generate(input_ids=[1, 2], sampling_params=dict(GREEDY, max_new_tokens=3), top_logprobs_num=2)
    assert "output_token_logprobs" not in res["meta_info"]  # as SGLang: nothing without return_logprob


@pytest.mark.slow
def test_n_samples(models):  # noqa: F811
    """n samples per prompt: seeded ones reproducible, different from each other."""
    eng = engine(models, "EAGLE", "eagle", knobs=(3, 2, 5))
    params = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=11, n=4)
    a = eng.generate(input_ids=PROMPTS[:2], sampling_params=params)
    assert len(a) == 8
    b = eng.generate(input_ids=PROMPTS[:2], sampling_params=params)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    assert len({tuple(r["output_ids"]) for r in a[:4]}) > 1
    # sample 0 is the request with the seed itself
    one = eng.generate(input_ids=PROMPTS[0], sampling_params=dict(params, n=1))
    assert one["output_ids"] == a[0]["output_ids"]
    single = eng.generate(input_ids=PROMPTS[0], sampling_params=dict(params, n=2))
    assert isinstance(single, list) and len(single) == 2


def test_logprob_top_k_is_no_vocabulary_sort():
    """The top alternatives come from XLA's TopK, not a sort of the vocabulary, and no branch."""
    import jax
    import jax.numpy as jnp
    from test_sampling import assert_no_vocab_sort_or_branch

    from jaxspec.logprobs import MAX_TOP_LOGPROBS, compute

    v = 4096
    logits = jnp.zeros((4, 3, v), jnp.float32)
    tokens = jnp.zeros((4, 3), jnp.int32)
    temp = jnp.ones((4,), jnp.float32)
    hlo = jax.jit(compute, static_argnums=3).lower(logits, tokens, temp, MAX_TOP_LOGPROBS).compile().as_text()
    assert_no_vocab_sort_or_branch(hlo, v)
    assert "TopK" in hlo

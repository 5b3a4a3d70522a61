"""Logprobs, echo and n > 1 over HTTP, with speculation on: OpenAI's chat and completion formats,
SGLang's /generate fields, values equal to HF transformers' log-softmax of the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import model_dirs, start  # noqa: F401 - model_dirs is a fixture

CHAT = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(model_dirs):  # noqa: F811
    s = start(
        model_dirs,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=model_dirs["draft"],
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
        max_running_requests=4,
        disable_cuda_graph=True,  # compile on first use: only the shapes these tests meet
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(model_dirs):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs["target"], torch_dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits / temperature, -1).numpy()


def generate(srv, body):
    st, r, _ = srv.request("POST", "/generate", body)
    assert st == 200, r
    return r


def test_generate_logprobs_match_hf_with_and_without_speculation(srv, hf):
    ids = [5, 6, 7, 8, 9, 10]
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": 0,
    }
    spec = generate(srv, body)
    plain = generate(srv, {**body, "speculative": False})
    assert spec["output_ids"] == plain["output_ids"]
    assert spec["meta_info"]["spec_verify_ct"] < 12  # drafts were accepted
    ref = hf_logprobs(hf, ids + spec["output_ids"])
    for r in (spec, plain):
        m = r["meta_info"]
        assert [e[1] for e in m["output_token_logprobs"]] == r["output_ids"]
        for i, (e, top) in enumerate(zip(m["output_token_logprobs"], m["output_top_logprobs"])):
            row = ref[len(ids) - 1 + i]
            assert abs(e[0] - row[e[1]]) < 1e-4
            assert [x[1] for x in top][0] == e[1] and len(top) == 3  # greedy: the token is the argmax
            np.testing.assert_allclose([x[0] for x in top], np.sort(row)[::-1][:3], atol=1e-4)
        inp = m["input_token_logprobs"]
        assert [e[1] for e in inp] == ids and inp[0][0] is None and m["input_top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(inp[i][0] - ref[i - 1][ids[i]]) < 1e-4


def test_generate_sampled_logprobs_and_token_text(srv, hf):
    ids = [11, 12, 13]
    r = generate(
        srv,
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True, "seed": 5},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    )
    m = r["meta_info"]
    ref = hf_logprobs(hf, ids + r["output_ids"], 0.8)
    for i, e in enumerate(m["output_token_logprobs"]):
        assert abs(e[0] - ref[len(ids) - 1 + i][e[1]]) < 1e-4 and isinstance(e[2], str)
    assert m["output_top_logprobs"] == [[]] * len(r["output_ids"])
    assert "input_token_logprobs" not in m


def test_chat_logprobs_format(srv):
    body = {"messages": CHAT, **GREEDY, "logprobs": True, "top_logprobs": 2}
    st, r, _ = srv.request("POST", "/v1/chat/completions", body)
    assert st == 200, r
    c = r["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 10
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
        assert e["bytes"] == list(e["token"].encode())
    # streamed: the same entries, piece by piece
    events = srv.stream("/v1/chat/completions", body)
    streamed = [e for ev in events for ch in ev["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert [(e["token"], round(e["logprob"], 4)) for e in streamed] == [
        (e["token"], round(e["logprob"], 4)) for e in content
    ]
    st, r, _ = srv.request("POST", "/v1/chat/completions", {"messages": CHAT, **GREEDY})
    assert r["choices"][0]["logprobs"] is None


def test_completion_echo_scores_the_prompt_like_lm_eval(srv, hf):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1, token prompts."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"prompt": [prompt], "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234}
    st, r, _ = srv.request("POST", "/v1/completions", body)
    assert st == 200, r
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(hf, prompt)
    for i in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1][prompt[i]]) < 1e-4
        # is_greedy, as lm-eval computes it: the token's logprob is the top one
        assert (lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())) == (
            int(np.argmax(ref[i - 1])) == prompt[i]
        )
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # the text holds the prompt, then the output; max_tokens 0 echoes the prompt alone
    st, r0, _ = srv.request("POST", "/v1/completions", {**body, "max_tokens": 0})
    assert st == 200, r0
    assert r["choices"][0]["text"].startswith(r0["choices"][0]["text"]) and r0["usage"]["completion_tokens"] == 0
    assert r0["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(prompt)]
    st, t, _ = srv.request("POST", "/v1/completions", {"prompt": "Once upon", "echo": True, **GREEDY, "max_tokens": 3})
    assert t["choices"][0]["text"].startswith("Once upon")


def test_n_choices_and_batched_prompts(srv):
    body = {"messages": CHAT, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "seed": 7, "n": 3}
    st, a, _ = srv.request("POST", "/v1/chat/completions", body)
    assert st == 200, a
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert a["usage"]["completion_tokens"] == 24 and len(a["spec_metrics"]) == 3
    _, b, _ = srv.request("POST", "/v1/chat/completions", body)
    texts = [c["message"]["content"] for c in a["choices"]]
    assert texts == [c["message"]["content"] for c in b["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1
    _, one, _ = srv.request("POST", "/v1/chat/completions", {**body, "n": 1})
    assert one["choices"][0]["message"]["content"] == texts[0]  # sample 0 uses the seed itself
    # streamed: every choice's pieces and its own finish
    events = srv.stream("/v1/chat/completions", body)
    got = {0: "", 1: "", 2: ""}
    fins = []
    for ev in events:
        for c in ev["choices"]:
            got[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"]:
                fins.append(c["index"])
    assert sorted(fins) == [0, 1, 2] and [got[i] for i in range(3)] == texts
    # completions: a choice per prompt and sample, prompt by prompt
    st, r, _ = srv.request("POST", "/v1/completions", {"prompt": [[5, 6], [7, 8, 9]], **GREEDY, "n": 2})
    assert st == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["text"] == r["choices"][1]["text"]  # greedy samples agree
    assert r["usage"]["prompt_tokens"] == 5
    # /generate: a list of results
    g = generate(srv, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "n": 2, "seed": 3}})
    assert isinstance(g, list) and [x["index"] for x in g] == [0, 1]


@pytest.mark.parametrize(
    "path,body,match",
    [
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 257}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": [[1]] * 100, "n": 3}, "choices"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt[1]"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
        ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, "n"),
        ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ],
)
def test_bad_logprob_and_n_requests_are_400(srv, path, body, match):
    st, r, _ = srv.request("POST", path, body)
    assert st == 400 and match in r["error"]["message"], r

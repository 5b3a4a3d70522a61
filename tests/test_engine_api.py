"""The Python API on the default model: SGLang-shaped results and clear errors."""

from __future__ import annotations

import pytest

import jaxspec
from jaxspec.errors import JaxspecError

SP = {"temperature": 0, "max_new_tokens": 8}


def test_generate_single_and_batch(default_engine):
    one = default_engine.generate("The capital of France is", SP)
    assert set(one) == {"text", "output_ids", "meta_info"}
    m = one["meta_info"]
    for k in (
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "e2e_latency",
        "spec_verify_ct",
        "spec_accept_length",
    ):
        assert k in m
    assert m["completion_tokens"] == len(one["output_ids"]) == m["spec_verify_ct"]
    assert m["spec_accept_length"] == 1.0
    assert one["text"] == default_engine.tokenizer.decode(one["output_ids"], skip_special_tokens=True)
    both = default_engine.generate(["The capital of France is", "1, 2, 3,"], SP)
    assert isinstance(both, list) and both[0]["output_ids"] == one["output_ids"]


def test_chat(default_engine):
    r = default_engine.chat(
        [{"role": "user", "content": "What is the capital of France?"}], {"temperature": 0, "max_new_tokens": 32}
    )
    assert "Paris" in r["text"]
    assert r["meta_info"]["finish_reason"]["type"] == "stop"
    rs = default_engine.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]], SP)
    assert len(rs) == 2


def test_stop_string(default_engine):
    free = default_engine.generate("1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 16})
    assert "7" in free["text"]
    r = default_engine.generate("1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 16, "stop": "7"})
    assert r["text"] == free["text"][: free["text"].index("7")]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "7"}
    assert r["output_ids"] == free["output_ids"][: len(r["output_ids"])]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt="x " * 9000), "context_length"),
        (dict(prompt="hi", sampling_params={"temperature": -1}), "temperature"),
        (dict(prompt="hi", sampling_params={"nope": 1}), "unknown sampling parameter"),
        (dict(input_ids=[1, 10**6]), "outside"),
        (dict(), "exactly one"),
    ],
)
def test_bad_input(default_engine, kwargs, match):
    with pytest.raises(JaxspecError, match=match):
        default_engine.generate(**kwargs)


def test_bad_chat_messages(default_engine):
    with pytest.raises(JaxspecError, match="role"):
        default_engine.chat([{"content": "no role"}])


def test_speculative_flag_errors_before_loading():
    with pytest.raises(JaxspecError, match="speculative_draft_model_path"):
        jaxspec.Engine(speculative_algorithm="STANDALONE")
    with pytest.raises(JaxspecError, match="BFS or PROB"):
        jaxspec.Engine(speculative_algorithm="NGRAM", speculative_ngram_match_type="DFS")
    with pytest.raises(JaxspecError, match="unknown speculative_algorithm"):
        jaxspec.Engine(speculative_algorithm="MAGIC")


def test_one_call_generate():
    r = jaxspec.generate("Hello", {"temperature": 0, "max_new_tokens": 4}, show_progress=False)
    assert r["meta_info"]["completion_tokens"] == 4

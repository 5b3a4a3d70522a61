"""The real default model: greedy decoding is token-identical to HF transformers' GGUF loader."""

from __future__ import annotations

import os

import pytest
import torch

from jaxspec.default_model import default_gguf_path

RAW = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = ["What is 2 + 2?", "Write a haiku about the sea.", "Give me three tips for learning Python."]
NEW = 48


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_gguf_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(tok, model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=2)
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_greedy_matches_hf_gguf_loader(default_engine, hf):
    tok, model = hf
    eng = default_engine
    prompts = [eng.encode(p) for p in RAW] + [
        eng.encode(eng.apply_chat_template([{"role": "user", "content": c}]), False) for c in CHAT
    ]
    ref_prompts = [tok(p).input_ids for p in RAW] + [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for c in CHAT
    ]
    assert prompts == ref_prompts  # same tokenizer and chat template as transformers
    ours = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": NEW})
    for p, o in zip(prompts, ours):
        assert o["output_ids"] == hf_greedy(tok, model, p)
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in ours)  # EOS reached at least once

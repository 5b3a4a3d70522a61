"""Speculative decoding on the real SmolLM2 target: random-weight drafts (and NGRAM) stay lossless at temperature 0."""

from __future__ import annotations

import json

import pytest

from jaxspec.default_model import default_model_path
from jaxspec.engine import Engine

from helpers import save_eagle_head

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn."]
SP = {"temperature": 0, "max_new_tokens": 24}


@pytest.mark.slow
def test_smollm2_random_drafts_are_lossless(default_engine, tmp_path):
    cfg = json.load(open(f"{default_model_path(progress=False)}/config.json"))
    plain = [r["output_ids"] for r in default_engine.chat([[{"role": "user", "content": p}] for p in PROMPTS], SP)]
    eagle3 = save_eagle_head(tmp_path / "e3", "EAGLE3", cfg, seed=0, draft_vocab=2048)
    eagle = save_eagle_head(tmp_path / "e2", "EAGLE", cfg, seed=1)
    for algo, path, knobs in [
        ("EAGLE3", eagle3, None),
        ("EAGLE", eagle, (3, 2, 4)),
        ("STANDALONE", "default", (3, 1, 4)),
        ("NGRAM", None, None),
    ]:
        kw = (
            {}
            if knobs is None
            else dict(
                speculative_num_steps=knobs[0], speculative_eagle_topk=knobs[1], speculative_num_draft_tokens=knobs[2]
            )
        )
        if algo == "STANDALONE":  # the target itself as the draft: unquantized (on CPU a draft runs in int8 by default)
            kw["speculative_draft_model_quantization"] = "unquant"
        eng = Engine(
            show_progress=False, dtype="float32", speculative_algorithm=algo, speculative_draft_model_path=path, **kw
        )
        out = eng.chat([[{"role": "user", "content": p}] for p in PROMPTS], SP)
        assert [r["output_ids"] for r in out] == plain
        if algo == "STANDALONE":  # the target drafting for itself: every round but the last emits num_steps + 1
            for r in out:
                assert r["meta_info"]["spec_accept_histogram"][:-1] == [0, 0, 0]


# Every tree shape in SGLang's speculative-decoding documentation, (num_steps, topk, num_draft_tokens):
# the EAGLE-2 / EAGLE-3 examples, the OOM guide's shapes and its recovery recipe (2, 2, 8), whose N
# is lowered to the 7 nodes its tree holds.
SGLANG_DOC_SHAPES = [(3, 4, 16), (5, 8, 64), (4, 2, 7), (2, 2, 8), (5, 4, 8), (4, 1, 5), (1, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("head", ["eagle2", "eagle3"])
def test_sglang_documented_shapes_are_lossless_with_shipped_heads(default_engine, head):
    import os

    import jaxspec.drafts

    path = os.path.join(os.path.dirname(jaxspec.drafts.__file__), f"smollm2-135m-instruct-{head}")
    algo = "EAGLE3" if head == "eagle3" else "EAGLE"
    conv = [[{"role": "user", "content": PROMPTS[1]}]]
    sp = {"temperature": 0, "max_new_tokens": 16}
    plain = default_engine.chat(conv, sp)[0]["output_ids"]
    for steps, topk, n in SGLANG_DOC_SHAPES:
        eng = Engine(
            show_progress=False,
            dtype="float32",
            speculative_algorithm=algo,
            speculative_draft_model_path=path,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=n,
            speculative_adaptive=False,
        )
        assert eng.spec.num_draft_tokens == min(n, 1 + topk + (steps - 1) * topk * topk)
        assert eng.chat(conv, sp)[0]["output_ids"] == plain, (steps, topk, n)

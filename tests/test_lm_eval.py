"""A real evaluation client: lm-evaluation-harness's `local-completions` model against `jaxspec
serve` (speculation on) scores a multiple-choice task (prompt logprobs through `echo`) and a
generation task, both defined from local files, and agrees with lm-eval's own `hf` backend on the
same weights: the same per-choice log-likelihoods (within 1e-3), the same greedy generations, the
same scores."""

from __future__ import annotations

import json

import pytest

from helpers import KEY, model_dirs, start  # noqa: F401 - model_dirs is a fixture

lm_eval = pytest.importorskip("lm_eval")

MC = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Paris is in", "choices": [" Spain", " France", " Japan", " Peru"], "answer": 1},
    {"question": "Water is", "choices": [" wet", " dry"], "answer": 0},
]
GEN = [{"question": "Q: Name a colour.\nA:", "answer": " red"}, {"question": "Count: one, two,", "answer": " three"}]


def write_tasks(d) -> None:
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN))
    (d / "jaxspec_mc.yaml").write_text(
        f"""task: jaxspec_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
    )
    (d / "jaxspec_gen.yaml").write_text(
        f"""task: jaxspec_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )


def evaluate(model: str, model_args: str, tasks_dir) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["jaxspec_mc", "jaxspec_gen"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )


@pytest.mark.slow
def test_lm_eval_local_completions_matches_hf_backend(model_dirs, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    write_tasks(tmp_path)
    srv = start(
        model_dirs,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=model_dirs["draft"],
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
        max_running_requests=2,
        cuda_graph_max_bs=2,
    )
    try:
        ours = evaluate(
            "local-completions",
            f"model=default,base_url=http://127.0.0.1:{srv.port}/v1/completions,tokenizer={model_dirs['target']},"
            "tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=256",
            tmp_path,
        )
    finally:
        srv.stop()
    ref = evaluate("hf", f"pretrained={model_dirs['target']},dtype=float32,device=cpu,max_length=256", tmp_path)
    for task in ("jaxspec_mc", "jaxspec_gen"):
        a, b = ours["samples"][task], ref["samples"][task]
        assert len(a) == len(b) == (len(MC) if task == "jaxspec_mc" else len(GEN))
        for x, y in zip(sorted(a, key=lambda s: s["doc_id"]), sorted(b, key=lambda s: s["doc_id"])):
            if task == "jaxspec_mc":
                for (lx, gx), (ly, gy) in zip(x["filtered_resps"], y["filtered_resps"]):
                    assert abs(float(lx) - float(ly)) < 1e-3 and gx == gy
            else:
                assert x["filtered_resps"] == y["filtered_resps"]
    assert ours["results"]["jaxspec_mc"]["acc,none"] == ref["results"]["jaxspec_mc"]["acc,none"]
    assert ours["results"]["jaxspec_gen"]["exact_match,none"] == ref["results"]["jaxspec_gen"]["exact_match,none"]

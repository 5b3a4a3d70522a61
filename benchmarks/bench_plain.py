"""Plain decoding, batch 1: jaxspec vs HF transformers `generate`, same weights, same run.

    python benchmarks/bench_plain.py [--prompts 10] [--new 128] [--dtype float32]

Both decode exactly --new tokens (EOS ignored) greedily for MT-bench first-turn questions in the
chat template; tokens/s = new tokens / end-to-end latency (prefill included). Also prints the
memory-bandwidth roofline: weight bytes read per token / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import copy_bandwidth, jax_read_bandwidth, machine, mtbench_first_turns, synthetic_layers_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    import jaxspec

    eng = jaxspec.Engine(dtype=args.dtype, show_progress=False, speculative_algorithm="NONE")
    questions = mtbench_first_turns(args.prompts)
    ids = [eng._encode(eng.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
    sp = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}

    t = time.perf_counter()
    for x in ids:  # compile every (prompt chunk, cache length) bucket the run will use
        eng.generate(input_ids=x, sampling_params=sp)
    compile_s = time.perf_counter() - t
    ours, ours_out = [], []
    for x in ids:
        r = eng.generate(input_ids=x, sampling_params=sp)
        ours.append(args.new / r["meta_info"]["e2e_latency"])
        ours_out.append(r["output_ids"])

    hf_tps, same = [], 0
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        from jaxspec.default_model import default_model_path

        torch.set_num_threads(2)
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        hf = AutoModelForCausalLM.from_pretrained(default_model_path(progress=False), dtype=dt).eval()
        gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=2)
        with torch.no_grad():
            hf.generate(torch.tensor([ids[0]]), **gen)  # warm-up
            for x, o in zip(ids, ours_out):
                t = time.perf_counter()
                out = hf.generate(torch.tensor([x]), **gen)
                hf_tps.append(args.new / (time.perf_counter() - t))
                same += out[0, len(x) :].tolist() == o

    weight_bytes = sum(np.asarray(v).nbytes for v in __import__("jax").tree_util.tree_leaves(eng.params))
    bw = copy_bandwidth()
    roof = bw / weight_bytes
    read_bw = jax_read_bandwidth()
    c = eng.cfg
    syn = synthetic_layers_ms(c.hidden_size, c.intermediate_size, c.num_kv_heads * c.head_dim, c.num_layers)
    med = statistics.median
    print(f"machine: {machine()}")
    print(
        f"model: SmolLM2-135M-Instruct ({args.dtype}), batch 1, {len(ids)} MT-bench first turns, {args.new} new tokens, greedy"
    )
    print(f"jaxspec warm-up pass (compiles every shape bucket, then runs): {compile_s:.1f} s")
    print(
        f"weight bytes/token: {weight_bytes / 1e6:.0f} MB; copy bandwidth: {bw / 1e9:.1f} GB/s; roofline: {roof:.1f} tok/s"
    )
    print(f"jitted XLA read bandwidth: {read_bw / 1e9:.1f} GB/s; read roofline: {read_bw / weight_bytes:.1f} tok/s")
    print(f"synthetic {c.num_layers}-layer matvec loop (no attention/norms/LM head): {syn:.1f} ms/token")
    print("| engine | median tok/s | min | max | % of roofline |")
    print("|---|---|---|---|---|")
    print(f"| jaxspec | {med(ours):.1f} | {min(ours):.1f} | {max(ours):.1f} | {100 * med(ours) / roof:.0f}% |")
    if hf_tps:
        print(
            f"| HF transformers {__import__('transformers').__version__} | {med(hf_tps):.1f} | {min(hf_tps):.1f} | {max(hf_tps):.1f} | {100 * med(hf_tps) / roof:.0f}% |"
        )
        print(f"speedup jaxspec / HF (median): {med(ours) / med(hf_tps):.2f}x; identical outputs: {same}/{len(ids)}")


if __name__ == "__main__":
    main()

"""Plain decoding, batch 1: jaxspec vs HF transformers `generate`, same weights, same run.

    python benchmarks/bench_plain.py [--prompts 10] [--new 128] [--dtype float32] [--hf eager compiled]

Both decode exactly --new tokens (EOS ignored) greedily for MT-bench first-turn questions in the
chat template; tokens/s = new tokens / end-to-end latency (prefill included). Also prints the
memory-bandwidth roofline: weight bytes read per token / measured copy bandwidth.

HF modes (--hf, several allowed): `eager` (a dynamic cache), `static` (a static KV cache),
`compiled` (a static cache and `generate`'s own `torch.compile(mode="reduce-overhead")` of the
decoding step, which replays CUDA graphs on a GPU: what a user who wants HF fast would pick). torch
runs on the GPU when it has one. Each row prints as soon as it is measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import copy_bandwidth, jax_read_bandwidth, machine, mtbench_first_turns, synthetic_layers_ms

from jaxspec.args import ModelArgs
from jaxspec.cli_flags import add_arguments


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf", nargs="+", default=["eager"], choices=["eager", "static", "compiled"], help="HF modes")
    add_arguments(ap, ModelArgs, title="model", only=("model_path", "dtype"))
    args = ap.parse_args()
    if args.dtype == "auto":  # float32, HF transformers' reference, rather than the CPU's gguf default
        args.dtype = "float32"

    import jaxspec

    eng = jaxspec.Engine(args.model_path, dtype=args.dtype, show_progress=False, speculative_algorithm="NONE")
    questions = mtbench_first_turns(args.prompts)
    ids = [eng.encode(eng.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
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
    print(
        f"| jaxspec | {med(ours):.1f} | {min(ours):.1f} | {max(ours):.1f} | {100 * med(ours) / roof:.0f}% |", flush=True
    )
    if args.skip_hf:
        return
    from jaxspec.default_model import default_model_path

    path = args.model_path or default_model_path(progress=False)
    for mode in args.hf:  # each row as soon as it is measured (a slow compile does not hide the others)
        t = time.perf_counter()
        tps, same = hf_decode(path, mode, args.dtype, ids, ours_out, args.new)
        name = f"HF transformers {__import__('transformers').__version__}, {mode}"
        print(f"| {name} | {med(tps):.1f} | {min(tps):.1f} | {max(tps):.1f} | {100 * med(tps) / roof:.0f}% |")
        print(
            f"speedup jaxspec / HF {mode} (median): {med(ours) / med(tps):.2f}x; identical outputs: {same}/{len(ids)}"
            f" ({time.perf_counter() - t:.0f} s with HF's load and warm-up)",
            flush=True,
        )


def hf_decode(path: str, mode: str, dtype: str, ids: list, ours_out: list, new: int) -> tuple[list[float], int]:
    """HF `generate` in one mode over the prompts (one warm-up pass first: compiles and captures
    graphs): (tokens/s per prompt, how many outputs equal jaxspec's)."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        torch.set_num_threads(2)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if dev == "cuda" and dt == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 as jaxspec computes it
    from transformers import GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(dev).eval()
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2)
    knows = GenerationConfig().to_dict()
    if mode in ("static", "compiled"):
        gen["cache_implementation"] = "static"
    if mode == "static" and "disable_compile" in knows:
        gen["disable_compile"] = True  # a static cache alone (`generate` compiles with one on a GPU)
    if mode == "compiled":
        try:  # as HF documents it: `generate` compiles the decoding step (one token, fixed shapes) only
            from transformers import CompileConfig

            gen["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
        except ImportError:  # an older transformers: the whole forward, prefill shapes included
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    tps, same = [], 0
    with torch.no_grad():
        # warm-up: compiles and captures the graphs; the longest prompt first sizes the static cache
        # that later calls reuse
        for x in [max(ids, key=len), ids[0]]:
            hf.generate(torch.tensor([x], device=dev), **gen)
        for x, o in zip(ids, ours_out):
            sync()
            t = time.perf_counter()
            out = hf.generate(torch.tensor([x], device=dev), **gen)
            sync()
            tps.append(new / (time.perf_counter() - t))
            same += out[0, len(x) :].tolist() == o
    return tps, same


if __name__ == "__main__":
    main()

"""Greedy speculative output against plain decoding of the same target, on the real model.

For each group "BASE:CONFIG,CONFIG" (configurations of bench_quant.py), BASE decodes MT-bench first
turns greedily (chat template, EOS ignored) and each CONFIG decodes them again; a row reports tok/s,
how many outputs are token-identical to BASE's and the mean share of tokens before the first
difference. Speculation is lossless when every speculative row reads N/N and 1.000.

    python benchmarks/bench_lossless.py --groups "gguf:gguf+draft,gguf+adaptive" "w8a8:w8a8+draft"
    python benchmarks/bench_lossless.py --xla-attention ...   # XLA's attention instead of the native kernel
"""

from __future__ import annotations

import argparse
import json
import time

from bench_quant import CONFIGS
from common import machine, mtbench_first_turns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", nargs="+", default=["gguf:gguf+draft", "w8a8:w8a8+draft", "f32:f32+draft"])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--xla-attention", action="store_true", help="attention in XLA, not the native CPU kernel")
    args = ap.parse_args()

    import jaxspec
    import jaxspec.attention

    if args.xla_attention:
        jaxspec.attention.NATIVE_ROWS = 0
    print(machine(), "attention:", "xla" if args.xla_attention else "native kernel where it applies")
    questions = mtbench_first_turns(args.prompts)
    sp = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
    for group in args.groups:
        base, others = group.split(":")
        ref, ids = None, None
        for name in [base, *others.split(",")]:
            kw = dict(CONFIGS[name])
            kw.setdefault("speculative_algorithm", "NONE")
            eng = jaxspec.Engine(show_progress=False, **kw)
            if ids is None:
                ids = [eng.encode(eng.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
            eng.generate(input_ids=ids[0], sampling_params=sp)  # compiles
            t = time.perf_counter()
            outs = [eng.generate(input_ids=x, sampling_params=sp)["output_ids"] for x in ids]
            tps = len(ids) * args.new / (time.perf_counter() - t)
            ref = outs if ref is None else ref
            same = sum(o == r for o, r in zip(outs, ref))
            first = [
                next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) / len(r) for o, r in zip(outs, ref)
            ]
            row = {"config": name, "tok_s": round(tps, 1), "identical": f"{same}/{len(ids)}"}
            print(json.dumps(row | {"agreement": round(sum(first) / len(ids), 3)}), flush=True)
            del eng


if __name__ == "__main__":
    main()

"""MT-bench (first turns), plain decoding vs speculative drafts, side by side in one run.

    python benchmarks/bench_mtbench.py --draft EAGLE3=path/to/head [--draft EAGLE=path] \\
        [--questions 80] [--max-new-tokens 128] [--temperatures 0 1] [--batch-size 1] \\
        [--attention-backend xla|pallas] [--quantization int8|fp8|w8a8_int8|gguf] [--draft-quantization MODE]

A draft given as ALGO:static (e.g. EAGLE3:static, the shipped head) runs with adaptive speculation
off (its tree shape every round); otherwise adaptive speculation has its default (on for the
shipped drafts), and the share of rounds it ran without speculation is printed. A tree shape
(num_steps/eagle_topk/num_draft_tokens) may follow an "@": EAGLE3:static@3/1/4. ALGO:target-only
(or ALGO:static,target-only) keeps SGLang's target-only acceptance for sampled requests instead of
drawing a path of drafts from the draft distribution. ALGO:decode runs verification and the draft's
extend with --speculative-attention-mode decode. ALGO:unquant (or int8, fp8, w8a8_int8) sets that
draft's --speculative-draft-model-quantization, over --draft-quantization (modes combine:
EAGLE3:static,decode@2/1/3, EAGLE3:static,unquant).

--compare-layouts (CPU): every engine runs twice, with the out-major kernels CPU engines use and
with in-major ones ("(in-major)" rows), side by side in the same run.

For every temperature it runs plain decoding and each draft over the same questions (chat template,
warm-up pass first so that compilation is not timed; the engines take turns question by question) and prints accept length (tokens per
verification round, bonus included), tokens/s, speedup over plain, and what a round costs in plain
decoding steps (accept length / speedup: the break-even accept length of that draft and shape); it
writes an accept-length histogram (SVG) per draft next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from common import machine, mtbench_first_turns

from jaxspec.args import ModelArgs
from jaxspec.bench import mtbench_categories, warmup_set
from jaxspec.cli_flags import add_arguments

DRAFT_QUANT = ("unquant", "int8", "fp8", "w8a8_int8")  # --draft modes: one engine's draft quantization


def run(engines, ids, sp, bs) -> list[tuple]:
    """Every engine over the same batches, interleaved batch by batch (so that a machine whose speed
    drifts during the run slows them alike), after a warm-up of each. Returns per engine (tokens,
    adaptive speculation's plain steps, speculative rounds, seconds, accept-length histogram,
    rounds per adaptive shape)."""
    for _, eng in engines:
        for batch in warmup_set(eng, ids, sp["max_new_tokens"], bs):
            eng.generate(input_ids=batch, sampling_params=sp)
    acc = [dict(tokens=0, plain=0, verify=0, dt=0.0, hist=None, shapes={}, per_q=[]) for _ in engines]
    for s in range(0, len(ids), bs):
        for (_, eng), a in zip(engines, acc):
            t = time.perf_counter()
            out = eng.generate(input_ids=ids[s : s + bs], sampling_params=sp)
            a["dt"] += time.perf_counter() - t
            for r in out:
                m = r["meta_info"]
                # per question: (tokens from speculative rounds, rounds), for per-category accept lengths
                a["per_q"].append((m["completion_tokens"] - m.get("spec_plain_steps", 0), m["spec_verify_ct"]))
                a["tokens"] += m["completion_tokens"]
                a["verify"] += m["spec_verify_ct"]
                a["plain"] += m.get("spec_plain_steps", 0)
                h = m.get("spec_accept_histogram")
                if h is not None:
                    a["hist"] = h if a["hist"] is None else [x + y for x, y in zip(a["hist"], h)]
                for k, v in m.get("spec_shapes", {}).items():
                    a["shapes"][k] = a["shapes"].get(k, 0) + v
    return [(a["tokens"], a["plain"], a["verify"], a["dt"], a["hist"], a["shapes"], a["per_q"]) for a in acc]


def per_category(per_q: list[tuple[int, int]], cats: list[str]) -> dict[str, float]:
    """{category: tokens from speculative rounds / rounds} over the questions of each category."""
    out: dict[str, list[int]] = {}
    for (tokens, rounds), c in zip(per_q, cats):
        t = out.setdefault(c, [0, 0])
        t[0] += tokens
        t[1] += rounds
    return {c: t / r for c, (t, r) in out.items() if r}


def histogram_svg(hist, title, path, width=480, height=260):
    pad, n = 40, len(hist)
    top = max(hist) or 1
    bw = (width - 2 * pad) / n
    bars = "".join(
        f'<rect x="{pad + i * bw + 2:.1f}" y="{height - pad - (height - 2 * pad) * c / top:.1f}" width="{bw - 4:.1f}" '
        f'height="{(height - 2 * pad) * c / top:.1f}" fill="#2471a3"/><text x="{pad + (i + 0.5) * bw:.1f}" y="{height - pad + 15}" '
        f'text-anchor="middle">{i + 1}</text>'
        for i, c in enumerate(hist)
    )
    with open(path, "w") as f:
        f.write(
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">'
            f'<rect width="100%" height="100%" fill="white"/>{bars}<text x="{pad}" y="20">{title}</text>'
            f'<text x="{width / 2}" y="{height - 5}" text-anchor="middle">tokens emitted per round</text></svg>'
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--draft",
        action="append",
        default=[],
        help="ALGO=PATH or ALGO (repeatable), e.g. EAGLE3=path/to/head, EAGLE3 (the shipped draft), NGRAM; "
        "ALGO:static turns adaptive speculation off, ALGO:target-only sampled drafts, ALGO:decode the decode "
        "attention mode, ALGO:unquant (or int8, fp8, w8a8_int8) that draft's quantization (comma-separated: several)",
    )
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/out")
    add_arguments(ap, ModelArgs, title="model", only=("model_path",))
    ap.add_argument(
        "--attention-backend", default=None, help="xla or pallas for every engine (default: the platform's)"
    )
    ap.add_argument(
        "--quantization",
        default=None,
        help="int8, fp8, w8a8_int8 or gguf (the default model's GGUF blocks) for every engine's target, and "
        "its draft unless --draft-quantization says otherwise",
    )
    ap.add_argument(
        "--draft-quantization", default=None, help="--speculative-draft-model-quantization for every engine"
    )
    ap.add_argument(
        "--compare-layouts",
        action="store_true",
        help="also run every engine with in-major kernels (CPU engines use out-major ones)",
    )
    args = ap.parse_args()

    import jaxspec
    from jaxspec.loader import load

    os.makedirs(args.out, exist_ok=True)
    loaded = load(
        args.model_path, "float32", progress=False, quantization="gguf" if args.quantization == "gguf" else None
    )
    common_kw = dict(
        _loaded=loaded,
        max_running_requests=args.batch_size,
        show_progress=False,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
        speculative_draft_model_quantization=args.draft_quantization,
    )
    configs = [("NONE", dict(speculative_algorithm="NONE"))]
    for d in args.draft:
        name, _, path = d.partition("=")  # "EAGLE3" alone: the draft shipped for the default model
        algo_mode, _, shape = name.partition("@")
        algo, _, mode = algo_mode.partition(":")
        modes = set(mode.split(",")) - {""}
        quant = {m for m in modes if m in DRAFT_QUANT}
        modes -= quant
        if modes - {"static", "target-only", "decode"} or len(quant) > 1:
            ap.error(
                f"unknown draft mode in {name!r}: use static, target-only, decode and/or one of {', '.join(DRAFT_QUANT)}"
            )
        steps, topk, n = (int(x) for x in shape.split("/")) if shape else (None, None, None)
        kw = dict(
            speculative_adaptive=False if "static" in modes else None,
            speculative_algorithm=algo,
            speculative_draft_model_path=path or None,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=n,
        )
        if "decode" in modes:
            kw["speculative_attention_mode"] = "decode"
        if "target-only" in modes:
            kw["_draft_sampling"] = False
        if quant:
            kw["speculative_draft_model_quantization"] = quant.pop()
        configs.append((f"{name} ({os.path.basename(path.rstrip('/'))})" if path else name, kw))
    if args.compare_layouts:
        configs += [(f"{name} (in-major)", {**kw, "_out_major": False}) for name, kw in configs]
    engines = [(name, jaxspec.Engine(**{**common_kw, **kw})) for name, kw in configs]
    plain = engines[0][1]
    qs = mtbench_first_turns(args.questions)
    cats = mtbench_categories(args.questions)
    ids = [plain.encode(plain.apply_chat_template([{"role": "user", "content": q}]), False) for q in qs]
    print(f"machine: {machine()}")
    print(
        f"SmolLM2-135M-Instruct float32{' ' + args.quantization if args.quantization else ''}, {len(ids)} MT-bench first turns, max {args.max_new_tokens} new tokens, "
        f"batch {args.batch_size}, attention backend {plain.backend}"
    )
    print(
        "| temperature | algorithm | accept length | tok/s | speedup | round / plain step | rounds per shape (adaptive) |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for temp in args.temperatures:
        sp = (
            {"temperature": temp, "max_new_tokens": args.max_new_tokens, "seed": 0}
            if temp > 0
            else {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        )
        bases: dict[bool, float] = {}  # plain tokens/s of each kernel layout: the speedups' base
        for (algo, _), (tokens, plain, verify, dt, hist, shapes, per_q) in zip(
            engines, run(engines, ids, sp, args.batch_size)
        ):
            total = max(sum(shapes.values()), 1)
            share = ", ".join(f"{k} {v / total:.0%}" for k, v in shapes.items()) if shapes else "-"
            tps = tokens / dt
            base = bases.setdefault(algo.endswith("(in-major)"), tps)
            acc = (tokens - plain) / max(verify, 1)  # per speculative round (plain steps apart)
            rows.append(
                dict(
                    temperature=temp,
                    algorithm=algo,
                    accept_length=acc,
                    tokens_per_s=tps,
                    speedup=tps / base,
                    round_cost=acc * base / tps,
                    histogram=hist,
                    shapes=shapes,
                    accept_length_per_category=per_category(per_q, cats),
                )
            )
            print(
                f"| {temp:g} | {algo} | {acc:.2f} | {tps:.1f} | {tps / base:.2f} | {acc * base / tps:.2f} | {share} |",
                flush=True,
            )
            if hist:
                histogram_svg(
                    hist,
                    f"{algo}, T={temp:g}: accept length {acc:.2f}",
                    os.path.join(args.out, f"accept_hist_{re.sub(r'[^A-Za-z0-9.]+', '-', algo)}_T{temp:g}.svg"),
                )
    with open(os.path.join(args.out, "mtbench.json"), "w") as f:
        json.dump(rows, f, indent=2)
    drafted = [r for r in rows if r["algorithm"] != "NONE"]
    if drafted:
        names = sorted({c for r in drafted for c in r["accept_length_per_category"]})
        print("\naccept length per MT-bench category")
        print("| temperature | algorithm | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for r in drafted:
            per = r["accept_length_per_category"]
            cells = " | ".join(f"{per[c]:.2f}" if c in per else "-" for c in names)
            print(f"| {r['temperature']:g} | {r['algorithm']} | {cells} |")


if __name__ == "__main__":
    main()

"""Qwen3-MoE vs a dense Qwen3 with the same *active* parameters: batch-1 decoding on the CPU, one run.

    python benchmarks/bench_moe.py [--layers 4] [--experts 16] [--top-k 8] [--expert-size 128]
                                   [--new 64] [--repeats 3] [--eagle3]

Two random-weight models (no hub), built with HF transformers (torch) as tests/helpers.py's
`make_hf_model` builds tiny models and written with `save_pretrained` to a temporary folder: a
Qwen3-MoE (hidden 512, 8 heads / 4 KV heads, head_dim 64, vocab 8192, every layer sparse with
--experts experts of intermediate size --expert-size, top --top-k renormalised) and a dense Qwen3
with the same attention and intermediate_size = top_k * expert_size, i.e. the same MLP parameters
per token (the MoE's router adds a hidden x experts matrix per layer). Both parameter counts (total
and active per token) print first.

Each engine (float32, no speculation) decodes a 32-token prompt of random ids, exactly --new greedy
tokens (EOS ignored), once to compile, then --repeats timed runs alternating dense / MoE; tok/s = new
tokens / end-to-end latency (prefill included). Reported: the median of each and MoE / dense. The
goal: MoE >= 0.8x dense (the extra cost of routing, sorting and grouped matmuls over the dense MLP).

--eagle3 also builds a random EAGLE-3 head for the MoE target and checks that greedy EAGLE-3
decoding gives the plain MoE tokens (lossless: True / False) with its accept length (a random head
accepts little: the point is token identity).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from common import machine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    initializer_range=0.3,  # as the tests: well-separated greedy tokens, no near-ties
)
EAGLE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)


def counts(model, experts: int, top_k: int) -> tuple[int, int]:
    """(total, active per token) parameters: of every expert stack only top_k / experts is used;
    tied embeddings count once (named_parameters lists a shared tensor once)."""
    total = active = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        active += n * top_k // experts if ".mlp.experts." in name else n
    return total, active


def build(d: str, args) -> dict:
    """Writes d/dense, d/moe (and d/eagle3); returns {"dense"/"moe": (total, active) parameters}."""
    import transformers

    from helpers import make_hf_model, save_eagle_head

    transformers.utils.logging.disable_progress_bar()  # save_pretrained's "Writing model shards"

    L, E, k, size = args.layers, args.experts, args.top_k, args.expert_size
    shape = dict(SHAPE, num_hidden_layers=L, max_position_embeddings=max(256, args.prompt + args.new + 64))
    out = {}
    dense = make_hf_model("qwen3", 0, intermediate_size=k * size, **shape)
    dense.save_pretrained(f"{d}/dense")
    out["dense"] = counts(dense, 1, 1)
    del dense
    moe = make_hf_model(
        "qwen3_moe",
        1,
        intermediate_size=k * size,  # unused: every layer is sparse
        num_experts=E,
        num_experts_per_tok=k,
        moe_intermediate_size=size,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        **shape,
    )
    moe.save_pretrained(f"{d}/moe")
    out["moe"] = counts(moe, E, k)
    if args.eagle3:
        aux = [0, L // 2, L - 1]  # distinct for L >= 3
        save_eagle_head(f"{d}/eagle3", "EAGLE3", moe.config.to_dict(), seed=2, scale=10.0, aux_layer_ids=aux)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-size", type=int, default=128, help="moe_intermediate_size")
    ap.add_argument("--prompt", type=int, default=32, help="prompt length (random ids)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eagle3", action="store_true", help="also check a random EAGLE-3 head is lossless")
    args = ap.parse_args()
    if args.eagle3 and args.layers < 3:
        ap.error("--eagle3 needs --layers >= 3 (three distinct auxiliary layers)")

    print(machine(), flush=True)
    import jaxspec

    with tempfile.TemporaryDirectory(prefix="bench_moe_") as d:
        t = time.perf_counter()
        n = build(d, args)
        print(f"built random checkpoints in {time.perf_counter() - t:.1f}s", flush=True)
        router = args.layers * SHAPE["hidden_size"] * args.experts
        for name, (total, active) in n.items():
            print(f"{name:>5}: {total / 1e6:8.2f}M parameters, {active / 1e6:8.2f}M active per token")
        print(
            f"MoE: {args.layers} layers x {args.experts} experts (top {args.top_k}, size {args.expert_size}); "
            f"dense: intermediate_size {args.top_k * args.expert_size}; the routers add {router / 1e6:.3f}M "
            f"active ({(n['moe'][1] - n['dense'][1]) / 1e6:+.3f}M in all)"
        )

        kw = dict(skip_tokenizer_init=True, show_progress=False, dtype="float32")
        engines = {name: jaxspec.Engine(f"{d}/{name}", speculative_algorithm="NONE", **kw) for name in ("dense", "moe")}
        ids = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], args.prompt).tolist()
        sp = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}

        def run(eng):
            r = eng.generate(input_ids=ids, sampling_params=sp)
            assert len(r["output_ids"]) == args.new, len(r["output_ids"])
            return r

        outs = {}
        for name, eng in engines.items():  # warm-up: compiles every shape the timed runs use
            t = time.perf_counter()
            outs[name] = run(eng)["output_ids"]
            print(f"{name:>5}: warm-up (compile) {time.perf_counter() - t:.1f}s", flush=True)
        tps: dict[str, list[float]] = {name: [] for name in engines}
        for i in range(args.repeats):
            for name, eng in engines.items():
                r = run(eng)
                assert r["output_ids"] == outs[name], f"{name}: greedy output changed between runs"
                tps[name].append(args.new / r["meta_info"]["e2e_latency"])
                print(f"  run {i + 1} {name:>5}: {tps[name][-1]:7.1f} tok/s", flush=True)
        med = {name: statistics.median(v) for name, v in tps.items()}
        ratio = med["moe"] / med["dense"]
        print(f"median tok/s: dense {med['dense']:.1f}, MoE {med['moe']:.1f}")
        print(f"MoE / dense: {ratio:.2f}x (goal >= 0.8x: {'met' if ratio >= 0.8 else 'NOT met'})")

        if args.eagle3:
            del engines["dense"]
            eng = jaxspec.Engine(
                f"{d}/moe",
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=f"{d}/eagle3",
                speculative_adaptive=False,  # the fixed tree below
                **EAGLE,
                **kw,
            )
            run(eng)  # compile
            r = run(eng)
            m = r["meta_info"]
            print(
                f"EAGLE-3 (random head, {EAGLE}): lossless: {r['output_ids'] == outs['moe']}, "
                f"accept length {m['spec_accept_length']:.2f}, {args.new / m['e2e_latency']:.1f} tok/s"
            )


if __name__ == "__main__":
    main()

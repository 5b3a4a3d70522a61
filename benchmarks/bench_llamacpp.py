"""llama.cpp beside jaxspec on the same GGUF, prompts and token counts, one run.

    python benchmarks/bench_llamacpp.py [--prompts 5] [--new 64] [--threads 2] [--configs default,gguf,gguf+draft,w8a8]
                                        [--temperature 1] [--skip-llamacpp] [--llamacpp-lookup 10]
                                        [--interleave] [--repeats 3]

Needs `llama-cpp-python` (not a jaxspec dependency: `pip install llama-cpp-python` builds llama.cpp
from source, about 10 minutes on 2 cores). The default model's GGUF (SmolLM2-135M-Instruct, Q4_1)
is decoded by llama.cpp as it is stored (4-bit weights, its own CPU kernels) and by jaxspec in each
configuration of `bench_quant.py` (gguf: the file's own blocks; the others dequantised to float32,
then quantized again as the configuration says). Batch 1, MT-bench first turns in the chat template (token ids made once by jaxspec's
tokenizer, given to both), exactly --new greedy tokens each (EOS ignored); tokens/s = new tokens /
end-to-end latency (prompt included) after a warm-up pass over every prompt. Greedy agreement: the
tokens before the first difference from jaxspec's first configuration, / --new; and the prompts whose
first 32 tokens equal llama.cpp's. With --temperature > 0 both sample from the temperature-scaled
distribution alone (no top-k, top-p or min-p on either side) and only speeds are compared.
--skip-llamacpp runs the jaxspec configurations alone (where llama-cpp-python is not installed);
--interleave holds them all at once and runs them prompt by prompt in turn (one at a time otherwise);
--repeats N keeps each jaxspec prompt's fastest of N runs (for a machine that another job shares at times).
Configuration `default` is `jaxspec.Engine()` with no options (on a CPU: the GGUF's own blocks, no
draft). --llamacpp-lookup N adds llama.cpp's speculative mode as its Python binding offers it:
prompt-lookup decoding (`LlamaPromptLookupDecoding`, N draft tokens from the context; the binding
takes no second model as a draft), beside jaxspec's own prompt lookup, configuration `gguf+ngram`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_quant import CONFIGS
from common import machine, mtbench_first_turns


def agreement(outs, ref, new: int) -> float:
    ks = [next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b))) for a, b in zip(outs, ref)]
    return statistics.mean(k / new for k in ks)


def llamacpp_outputs(
    path: str, ids: list[list[int]], new: int, threads: int, temperature: float = 0.0, lookup: int = 0
) -> tuple[list[list[int]], list[float]]:
    """llama.cpp's outputs and tokens/s per prompt; lookup > 0: with prompt-lookup drafts of that many tokens."""
    from llama_cpp import Llama

    kw = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, **kw)

    def run(x):
        out = []
        sample = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0) if temperature > 0 else dict(temp=0.0, top_k=1)
        for tok in llm.generate(x, reset=True, **sample):
            out.append(int(tok))
            if len(out) == new:
                return out
        return out

    for x in ids:
        run(x)
    outs, tps = [], []
    for x in ids:
        t = time.perf_counter()
        outs.append(run(x))
        tps.append(new / (time.perf_counter() - t))
    return outs, tps


def engine(name: str):
    import jaxspec

    kw = dict(CONFIGS[name])
    if name != "default":  # the others name their algorithm or run none
        kw.setdefault("speculative_algorithm", "NONE")
    return jaxspec.Engine(show_progress=False, **kw)


def timed(eng, x: list[int], sp: dict, new: int, repeats: int = 1) -> tuple[list[int], float]:
    """One request's output ids and its tokens/s, the fastest of `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = eng.generate(input_ids=x, sampling_params=sp)["output_ids"]
        best = min(best, time.perf_counter() - t)
    return out, new / best


def one_by_one(names, questions, sp, new, repeats) -> tuple[list, dict]:
    """Each configuration in turn, one engine in memory at a time: (prompt ids, {name: (outputs, tok/s)})."""
    ids, runs = None, {}
    for name in names:
        eng = engine(name)
        if ids is None:
            ids = [eng.encode(eng.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
        for x in ids:  # warm-up: compiles every shape the run uses
            eng.generate(input_ids=x, sampling_params=sp)
        runs[name] = tuple(map(list, zip(*(timed(eng, x, sp, new, repeats) for x in ids))))
        print(f"jaxspec {name:16s} {statistics.mean(runs[name][1]):7.1f} tok/s", flush=True)
        del eng
    return ids, runs


def interleaved(names, questions, sp, new, repeats) -> tuple[list, dict]:
    """Every engine held at once, taking turns prompt by prompt after a warm-up of each, so that a
    machine whose speed drifts (or that another job shares) slows them alike."""
    engines = {name: engine(name) for name in names}
    first = engines[names[0]]
    ids = [first.encode(first.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
    for eng in engines.values():
        for x in ids:
            eng.generate(input_ids=x, sampling_params=sp)
    runs: dict = {name: ([], []) for name in names}
    for x in ids:
        for name, eng in engines.items():
            out, tps = timed(eng, x, sp, new, repeats)
            runs[name][0].append(out)
            runs[name][1].append(tps)
    return ids, runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (XLA:CPU uses every core)")
    ap.add_argument(
        "--configs", default="default,gguf,gguf+draft,w8a8", help="jaxspec configurations of bench_quant.py"
    )
    ap.add_argument(
        "--llamacpp-lookup", type=int, default=0, help="N > 0: also llama.cpp with prompt-lookup drafts of N tokens"
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (agreement measured); > 0: speed only")
    ap.add_argument("--skip-llamacpp", action="store_true", help="jaxspec's configurations only")
    ap.add_argument(
        "--interleave", action="store_true", help="hold every jaxspec engine at once and take turns prompt by prompt"
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="jaxspec: time each prompt this many times, keep the fastest"
    )
    args = ap.parse_args()

    from jaxspec.default_model import default_gguf_path

    print(machine(), f"temperature {args.temperature}")
    questions = mtbench_first_turns(args.prompts)
    sp = {"temperature": args.temperature, "max_new_tokens": args.new, "ignore_eos": True}
    names = args.configs.split(",")
    ids, runs = (interleaved if args.interleave else one_by_one)(names, questions, sp, args.new, args.repeats)
    rows, ref, all_outs = [], runs[names[0]][0], []
    for name in names:
        outs, tps = runs[name]
        all_outs.append(outs)
        rows.append((f"jaxspec {name}", statistics.mean(tps), agreement(outs, ref, args.new)))
    if args.skip_llamacpp:
        print(f"\n| engine | tok/s | vs {rows[0][0]} | greedy agreement with {rows[0][0]} |")
        print("|---|---|---|---|")
        for name, t, ag in rows:
            print(f"| {name} | {t:.1f} | {t / rows[0][1]:.2f}× | {ag:.3f} |")
        return
    if args.llamacpp_lookup:
        outs, tps = llamacpp_outputs(
            default_gguf_path(), ids, args.new, args.threads, args.temperature, args.llamacpp_lookup
        )
        label = f"llama.cpp Q4_1 + prompt lookup {args.llamacpp_lookup}, {args.threads} threads"
        rows.append((label, statistics.mean(tps), agreement(outs, ref, args.new)))
        print(f"{rows[-1][0]:24s} {rows[-1][1]:7.1f} tok/s  agree {rows[-1][2]:.3f}", flush=True)
        all_outs.append(outs)
    outs, tps = llamacpp_outputs(default_gguf_path(), ids, args.new, args.threads, args.temperature)
    rows.append((f"llama.cpp Q4_1, {args.threads} threads", statistics.mean(tps), agreement(outs, ref, args.new)))
    print(f"{rows[-1][0]:24s} {rows[-1][1]:7.1f} tok/s  agree {rows[-1][2]:.3f}", flush=True)
    all_outs.append(outs)
    # prompts whose first 32 tokens equal llama.cpp's (the check: >= 9 of 10)
    same32 = [sum(a[:32] == b[:32] for a, b in zip(o, outs)) for o in all_outs]
    print(
        f"\n| engine | tok/s | vs llama.cpp | greedy agreement with {rows[0][0]} | prompts equal to llama.cpp over 32 tokens |"
    )
    print("|---|---|---|---|---|")
    for (name, t, ag), same in zip(rows, same32):
        print(f"| {name} | {t:.1f} | {t / rows[-1][1]:.2f}× | {ag:.3f} | {same} / {len(ids)} |")


if __name__ == "__main__":
    main()

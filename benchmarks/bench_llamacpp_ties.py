"""Why jaxspec's gguf mode and llama.cpp part on the same GGUF: near ties under int8 activations.

    python benchmarks/bench_llamacpp_ties.py [--prompts 10] [--new 32] [--threads 2]

Needs `llama-cpp-python` (see bench_llamacpp.py). Both engines quantize every layer's input to int8
per block of 32 before multiplying it by the 4-bit weights. A difference in the last bit of an input
can move a value across a rounding boundary and change that block's product by up to half a
quantization step, so two computations that are equal in float32 up to rounding part by far more
than rounding under this scheme. This benchmark measures how far, on the default model's GGUF, MT-bench
first turns in the chat template (token ids made once by jaxspec's tokenizer, given to both):

- each engine against itself: the log-probabilities of the same tokens (its own greedy output) from
  its single-token decoding path and from one batched pass over prompt and output, and where the
  batched pass's argmax is not the greedy token;
- the engines against each other: both batched passes over llama.cpp's greedy tokens;
- greedy outputs: the prompts whose first --new tokens are equal.

llama.cpp runs with its default float16 KV cache and with a float32 one. A margin is the reference's
log-probability gap between its top two tokens at a position where the argmaxes differ.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import machine, mtbench_first_turns


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


class Scores:
    """Per position of a greedy continuation: the log-probability of the token and its top two."""

    def __init__(self):
        self.lp, self.top, self.margin = [], [], []

    def add(self, lp: float, top: int, margin: float) -> None:
        self.lp.append(lp)
        self.top.append(top)
        self.margin.append(margin)


def jaxspec_runs(eng, ids, new: int, forced: list[list[int]] | None):
    """Greedy outputs with their decode-path scores, and batched (teacher-forced) scores of
    `forced` continuations (None: the engine's own outputs)."""
    outs, dec, bat = [], [], []
    for i, x in enumerate(ids):
        r = eng.generate(
            input_ids=x,
            sampling_params={"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
            return_logprob=True,
            top_logprobs_num=2,
        )
        outs.append(r["output_ids"])
        s = Scores()
        for (lp, _, _), top in zip(r["meta_info"]["output_token_logprobs"], r["meta_info"]["output_top_logprobs"]):
            s.add(lp, top[0][1], top[0][0] - top[1][0])
        dec.append(s)
        cont = (forced or outs)[i]
        # prompt + continuation: entry k + 1 of the input scores is cont[k]'s
        r = eng.generate(
            input_ids=x + cont,
            sampling_params={"temperature": 0, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=len(x) - 1,
            top_logprobs_num=2,
        )
        m = r["meta_info"]
        s = Scores()
        for (lp, _, _), top in zip(m["input_token_logprobs"][1:], m["input_top_logprobs"][1:]):
            s.add(lp, top[0][1], top[0][0] - top[1][0])
        bat.append(s)
    return outs, dec, bat


def llamacpp_runs(path: str, ids, new: int, threads: int, **kw):
    """llama.cpp's greedy outputs with decode-path scores, and a batched pass over each."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False, **kw
    )
    outs, dec, bat = [], [], []
    for x in ids:
        out = []
        for tok in llm.generate(x, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == new:
                break
        outs.append(out)
        for store in (dec, bat):
            if store is bat:
                llm.reset()
                llm.eval(x + out)
            lp = log_softmax(llm.scores[len(x) - 1 : len(x) - 1 + new])
            s = Scores()
            for k, row in enumerate(lp):
                two = np.sort(row)[-2:]
                s.add(float(row[out[k]]), int(row.argmax()), float(two[1] - two[0]))
            store.append(s)
    llm.close()
    return outs, dec, bat


def compare(name: str, a: list[Scores], b: list[Scores], conts: list[list[int]]) -> str:
    """a, b: scores of the same continuations conts; b is the reference for the argmax and margins."""
    d = np.abs(np.concatenate([np.subtract(x.lp, y.lp) for x, y in zip(a, b)]))
    flips = [[k for k in range(len(c)) if x.top[k] != y.top[k]] for x, y, c in zip(a, b, conts)]
    margins = [y.margin[k] for y, f in zip(b, flips) for k in f]
    med = f"{np.median(margins):.3f}" if margins else "-"
    mx = f"{max(margins):.3f}" if margins else "-"
    return (
        f"| {name} | {d.mean():.4f} | {np.quantile(d, 0.9):.4f} | {d.max():.4f} | {sum(map(len, flips))} / {d.size} | "
        f"{sum(bool(f) for f in flips)} / {len(conts)} | {med} / {mx} |"
    )


def equal(a, b, new: int) -> int:
    return sum(x[:new] == y[:new] for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = ap.parse_args()

    import jaxspec
    from jaxspec.default_model import default_gguf_path

    print(machine())
    questions = mtbench_first_turns(args.prompts)
    path = default_gguf_path()
    eng = jaxspec.Engine(show_progress=False, speculative_algorithm="NONE", quantization="gguf")
    ids = [eng.encode(eng.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
    ll16 = llamacpp_runs(path, ids, args.new, args.threads)
    ll32 = llamacpp_runs(path, ids, args.new, args.threads, type_k=0, type_v=0)  # GGML_TYPE_F32
    jaxspec_runs(eng, ids[:1], args.new, None)  # compile
    gg = jaxspec_runs(eng, ids, args.new, None)
    gg16 = jaxspec_runs(eng, ids, args.new, ll16[0])
    gg32 = jaxspec_runs(eng, ids, args.new, ll32[0])
    del eng
    eng = jaxspec.Engine(show_progress=False, dtype="float32", speculative_algorithm="NONE")
    jaxspec_runs(eng, ids[:1], args.new, None)
    f32 = jaxspec_runs(eng, ids, args.new, None)

    hdr = "| comparison | mean abs. Δ log-prob | p90 | max | positions whose argmax differs | prompts with one | margin there, median / max |"
    print(f"\n{args.prompts} prompts, {args.new} greedy tokens each\n\n{hdr}\n|---|---|---|---|---|---|---|")
    print(compare("jaxspec float32: batched vs decoding", f32[2], f32[1], f32[0]))
    print(compare("jaxspec gguf: batched vs decoding", gg[2], gg[1], gg[0]))
    print(compare("llama.cpp, KV float16: batched vs decoding", ll16[2], ll16[1], ll16[0]))
    print(compare("llama.cpp, KV float32: batched vs decoding", ll32[2], ll32[1], ll32[0]))
    print(compare("jaxspec gguf vs llama.cpp KV float16, both batched", gg16[2], ll16[2], ll16[0]))
    print(compare("jaxspec gguf vs llama.cpp KV float32, both batched", gg32[2], ll32[2], ll32[0]))
    n = f"{args.new} tokens"
    print(f"\n| greedy outputs | prompts equal over {n} |\n|---|---|")
    print(f"| jaxspec gguf, llama.cpp KV float16 | {equal(gg[0], ll16[0], args.new)} / {len(ids)} |")
    print(f"| jaxspec gguf, llama.cpp KV float32 | {equal(gg[0], ll32[0], args.new)} / {len(ids)} |")
    print(f"| llama.cpp KV float16, llama.cpp KV float32 | {equal(ll16[0], ll32[0], args.new)} / {len(ids)} |")
    print(f"| jaxspec gguf, jaxspec float32 | {equal(gg[0], f32[0], args.new)} / {len(ids)} |")


if __name__ == "__main__":
    main()

"""Pallas attention on the GPU: kernels vs XLA, and what they buy a Llama-3.1-8B-shaped model.

    python benchmarks/bench_attention.py [--kernels] [--model] [--smoke]

--kernels  decode (N = 1) and tree verification (N = 8..64) attention over a bf16 cache shaped like
           Llama-3.1-8B's (8 KV heads x GQA 4, head_dim 128), batch 1 and 8, context 1k/4k/16k:
           our Pallas kernel vs our XLA reference vs `jax.nn.dot_product_attention` (XLA, with the
           dense mask it needs), and for trees the decode attention mode (--speculative-attention-mode
           decode: the prefix through the decode kernel with the tree rows folded into the GQA group,
           the tree columns apart, merged). Times are medians of jitted calls; GB/s counts the K/V
           bytes read.
--model    a Llama-3.1-8B-shaped model with random bf16 weights, batch 1, context 1024:
           (a) the target forward of one decode step and of one verification tree of N = 8/16/32/64
               tokens, for both backends (the ratio verify(N) / decode is what speculation pays per
               round), (b) plain decoding end to end through `Engine.generate` (256 tokens) against
               the HBM roofline: weight bytes per token / bandwidth (nominal and measured), with bf16,
               int8 and fp8 weights (the engine's quantization option; those rows use pallas).
--smoke    tiny shapes on any machine (interpret mode off the GPU): checks the script, not speed.
Both sections run by default.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import jax_read_bandwidth, machine

NOMINAL_HBM = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s (SXM parts)


def median_ms(f, *args, reps=20):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def kernels(smoke: bool):
    from jaxspec.pallas_kernels.decode_attention import decode_attention
    from jaxspec.pallas_kernels.tree_attention import tree_attention, tree_attention_reference

    interpret = jax.default_backend() != "gpu"
    hkv, g, d = (2, 4, 64) if smoke else (8, 4, 128)
    rng = np.random.default_rng(0)
    from jaxspec.attention import attention

    print(
        "| B | context | N | pallas µs | xla-ref µs | jax.nn.dpa µs | pallas GB/s | pallas vs ref | pallas vs dpa "
        "| decode mode µs | decode mode vs pallas |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b in (1,) if smoke else (1, 8):
        for s in (256,) if smoke else (1024, 4096, 16384):
            k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
            for n in (1, 8) if smoke else (1, 8, 16, 32, 64):
                q = jnp.asarray(rng.standard_normal((b, n, hkv * g, d)), jnp.bfloat16)
                kv_len = jnp.full((b,), s - n, jnp.int32)
                parent = np.maximum(np.arange(n) - 1 - (np.arange(n) % 3 == 0), 0)  # a bushy tree
                anc = np.eye(n, dtype=bool)
                for i in range(1, n):
                    anc[i] |= anc[parent[i]]
                mask = jnp.asarray(np.broadcast_to(anc, (b, n, n)))
                if n == 1:
                    ours = jax.jit(functools.partial(decode_attention, interpret=interpret))
                    t_ours = median_ms(ours, q[:, 0], k, v, kv_len + 1)
                else:
                    ours = jax.jit(functools.partial(tree_attention, interpret=interpret))
                    t_ours = median_ms(ours, q, k, v, kv_len, mask)
                ref = jax.jit(tree_attention_reference)
                t_ref = median_ms(ref, q, k, v, kv_len, mask)
                # jax.nn.dot_product_attention needs the dense [B, 1, N, S] mask a tree implies.
                col = jnp.arange(s)[None, None, :]
                rel = col - kv_len[:, None, None]
                dense = (rel < 0) | (
                    (rel < n) & jnp.take_along_axis(mask, jnp.clip(rel, 0, n - 1).repeat(n, 1), axis=2)
                )
                dpa = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m[:, None]))
                t_dpa = median_ms(dpa, q, k, v, dense)
                gbs = 2 * b * s * hkv * d * 2 / (t_ours * 1e-3) / 1e9
                split = "– | – |"
                if n > 1:
                    t_split = median_ms(
                        jax.jit(functools.partial(attention, backend="pallas:decode")), q, k, v, kv_len, mask
                    )
                    split = f"{1e3 * t_split:.0f} | {t_ours / t_split:.2f}× |"
                print(
                    f"| {b} | {s} | {n} | {1e3 * t_ours:.0f} | {1e3 * t_ref:.0f} | {1e3 * t_dpa:.0f} | {gbs:.0f} | "
                    f"{t_ref / t_ours:.2f}× | {t_dpa / t_ours:.2f}× | {split}",
                    flush=True,
                )


def model(smoke: bool):
    from flax import nnx

    import jaxspec
    from jaxspec.cache import KVCache
    from jaxspec.config import ModelConfig
    from jaxspec.models.llama import LlamaForCausalLM
    from jaxspec.quant import weight_bytes

    if smoke:
        cfg = ModelConfig("llama", 256, 128, 256, 2, 8, 2, 64, 1e-5, 500000.0, max_position_embeddings=2048)
    else:  # Llama-3.1-8B (rope scaling does not change the cost)
        cfg = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, max_position_embeddings=8192)
    m = LlamaForCausalLM(cfg, jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m)
    wbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    ctx, s_len = (100, 256) if smoke else (1024, 2048)

    @functools.partial(jax.jit, static_argnames=("backend",), donate_argnames=("cache",))
    def forward(params, cache, tokens, pos, mask, backend):
        mdl = nnx.merge(graphdef, params)
        h, cache, _ = mdl(tokens, pos, cache, local_mask=mask, backend=backend)
        return jnp.argmax(mdl.logits(h), -1), cache

    def step_ms(n, backend):
        cache = KVCache.create(cfg, 1, s_len, jnp.bfloat16)
        cache = KVCache(cache.k, cache.v, jnp.full((1,), ctx, jnp.int32))
        tokens = jnp.ones((1, n), jnp.int32)
        pos = ctx + jnp.arange(n, dtype=jnp.int32)[None]
        mask = None if n == 1 else jnp.tril(jnp.ones((1, n, n), bool))
        out, cache = forward(params, cache, tokens, pos, mask, backend)  # compile
        ts = []
        for _ in range(5 if smoke else 30):
            t = time.perf_counter()
            out, cache = forward(params, cache, tokens, pos, mask, backend)
            out.block_until_ready()
            ts.append(time.perf_counter() - t)
        return 1e3 * statistics.median(ts)

    kind = jax.devices()[0].device_kind
    nominal = next((bw for name, bw in NOMINAL_HBM.items() if name in kind), None)
    measured = jax_read_bandwidth(1 << (24 if smoke else 31))
    print(
        f"\nmodel: {wbytes / 1e9:.2f} GB bf16 weights, batch 1, context {ctx}; read bandwidth measured "
        f"{measured / 1e9:.0f} GB/s" + (f", nominal {nominal / 1e9:.0f} GB/s" if nominal else "")
    )
    print("| backend | decode step ms | " + " | ".join(f"verify N={n} ms (× decode)" for n in (8, 16, 32, 64)) + " |")
    print("|---|---|---|---|---|---|")
    for backend in ("xla", "pallas"):
        dec = step_ms(1, backend)
        cells = [f"{v:.2f} ({v / dec:.2f}×)" for v in (step_ms(n, backend) for n in (8, 16, 32, 64))]
        print(f"| {backend} | {dec:.2f} | " + " | ".join(cells) + " |", flush=True)

    new = 32 if smoke else 256
    for backend, quant in (("xla", None), ("pallas", None), ("pallas", "int8"), ("pallas", "fp8")):
        eng = jaxspec.Engine.from_model(
            m,
            dtype="bfloat16",
            speculative_algorithm="NONE",
            attention_backend=backend,
            quantization=quant,
            skip_tokenizer_init=True,
            show_progress=False,
            context_length=s_len,
        )
        nbytes = weight_bytes(eng.params)  # what one decode step reads, the KV cache aside
        ids = list(range(10, 10 + ctx))
        sp = dict(temperature=0, max_new_tokens=new, ignore_eos=True)
        eng.generate(input_ids=ids, sampling_params=sp)  # compile
        lat = statistics.median(
            eng.generate(input_ids=ids, sampling_params=sp)["meta_info"]["e2e_latency"] for _ in range(3)
        )
        r2 = statistics.median(
            eng.generate(input_ids=ids, sampling_params=dict(sp, max_new_tokens=1))["meta_info"]["e2e_latency"]
            for _ in range(3)
        )  # prefill + first token
        tps = (new - 1) / (lat - r2) if lat > r2 else float("nan")  # decode tokens/s, prefill excluded
        line = (
            f"plain decode ({backend}, {quant or 'bf16'} weights, {nbytes / 1e9:.2f} GB): {new / lat:.1f} tok/s end to "
            f"end; decode alone {tps:.1f} tok/s = {tps * nbytes / measured:.0%} of the measured-bandwidth roofline"
        )
        if nominal:
            line += f", {tps * nbytes / nominal:.0%} of the nominal ({nominal / nbytes:.0f} tok/s)"
        print(line, flush=True)
        del eng
        gc.collect()  # free this engine's weights before the next is built


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--model", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    print(machine())
    both = not (args.kernels or args.model)
    if args.kernels or both:
        kernels(args.smoke)
    if args.model or both:
        model(args.smoke)


if __name__ == "__main__":
    main()

"""Weight quantization of a loaded model: `--quantization` (target) and
`--speculative-draft-model-quantization` (draft).

Modes (norms, embeddings, LM heads (but see head_int8 below) and the KV cache keep the model's dtype):
  int8       weight-only, symmetric int8 per output channel: w ≈ q * scale, q in [-127, 127],
             scale = max|w| / 127
  fp8        weight-only, float8 e4m3 per output channel: w ≈ q * scale, scale = max|w| / 448
             (e4m3's largest normal)
  w8a8_int8  int8 weights as `int8`, and each linear layer's input quantized to int8 per token at run
             time (dynamic, max|x| / 127); the matmul runs in int32 (models/llama.py:int8_matmul).
             SGLang's name for the same scheme. The fastest mode on CPU: few-row products run in
             jaxspec's native int8 kernel (jaxspec/native), many-row ones in XLA's int8 GEMM, while
             XLA:CPU fuses no weight conversion into its float matmuls.
  gguf       (target only, a GGUF file on CPU) the file's Q4_0 / Q4_1 / Q8_0 blocks kept as stored
             and multiplied by a native kernel (jaxspec/gguf.py); applied when the model loads
  unquant    (draft only) keep the draft unquantized (on a CPU a float or gguf target's draft
             runs in w8a8_int8 unless told otherwise: `draft_quantization`)

Under w8a8_int8 a target (or STANDALONE draft) also gets `head_int8`, an int8 copy of its LM head
[H, V] (of the tied embedding, transposed, when tied) that computes its logits: a float LM head
can weigh as much as all the int8 layers (SmolLM2-135M: 113 MB against 106 MB). The float
embedding / LM head stay (token embeddings and EAGLE drafts read them), so this costs V * H bytes
more memory. An EAGLE-3 draft's own LM head [H, Vd] is read only for the draft's logits, so under
w8a8_int8 it is quantized like the draft's layers: in float32 (SmolLM2's earlier head, 4,096 x 576) it was
two of the costliest ops of a CPU round, one product per draft step.
Mixture-of-experts blocks (Qwen3-MoE, models/moe.py) are not quantized yet: their routers and
stacked experts stay in the model's dtype under every mode (a warning says so).
Every `Linear` but LM heads gets an integer/fp8 `kernel` [in, out] and a float32 `scale` [out];
`Linear.__call__` computes (x @ q) * scale with q converted to x's dtype (XLA:GPU fuses that conversion
into the matmul; XLA:CPU materialises the float weight first, so on CPU it saves memory, not time);
w8a8_int8 Linears also set `act_int8`.
Quantizing after `fuse_projections` keeps one scale per fused output column, so the tensor-parallel
split of qkv_proj / gate_up_proj (on whole heads / columns) splits the scales the same way
(`sharding.param_spec`). Speculation stays lossless with respect to the quantized target: the
target that verifies is the quantized one.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
from flax import nnx

from jaxspec import native
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import Linear, LlamaForCausalLM
from jaxspec.models.moe import SparseMoeBlock

QMAX = {"int8": 127.0, "fp8": 448.0, "w8a8_int8": 127.0}
QDTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "w8a8_int8": jnp.int8}


def quantize_weight(w, mode: str):
    """w [in, out] float -> (q [in, out] int8 / float8_e4m3fn, scale [out] float32), w ≈ q * scale."""
    wf = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=0)
    scale = jnp.where(amax > 0, amax / QMAX[mode], 1.0)
    q = wf / scale
    if QDTYPE[mode] == jnp.int8:
        q = jnp.clip(jnp.round(q), -127, 127)
    return q.astype(QDTYPE[mode]), scale.astype(jnp.float32)


def quantize_model(model: nnx.Module, mode: str | None) -> nnx.Module:
    """In place: every Linear of `model` except LM heads (but a draft's own under w8a8_int8)
    quantized to `mode` (None / "unquant": unchanged). Returns `model`. The flags' values are
    checked in jaxspec/args.py."""
    if mode in (None, "unquant", "gguf"):  # gguf: the blocks were kept when the model loaded
        return model
    if mode not in QMAX:
        raise JaxspecError(f"unknown quantization {mode!r}; known: {', '.join(QMAX)}, unquant")
    nodes = list(nnx.iter_graph(model))
    if any(isinstance(m, SparseMoeBlock) for _, m in nodes):
        logging.getLogger("jaxspec").warning(
            "%s: the mixture-of-experts layers' routers and experts are not quantized (they stay float)", mode
        )
    # a target's LM head stays (w8a8_int8 adds head_int8 below); a draft's own LM head (EAGLE-3's
    # [H, Vd], read only for its logits) is quantized like its layers under w8a8_int8
    target_heads = {id(m.lm_head) for _, m in nodes if isinstance(m, LlamaForCausalLM) and m.lm_head is not None}
    for path, m in nodes:
        if not isinstance(m, Linear) or m.scale is not None or m.gguf:
            continue
        if path and path[-1] == "lm_head" and (id(m) in target_heads or mode != "w8a8_int8"):
            continue
        q, scale = quantize_weight(m.kernel[...], mode)
        m.kernel = nnx.Param(q)
        m.scale = nnx.data(nnx.Param(scale))
        m.act_int8 = mode == "w8a8_int8"
    if mode == "w8a8_int8":
        for m in [m for _, m in nnx.iter_graph(model) if isinstance(m, LlamaForCausalLM) and m.head_int8 is None]:
            w = m.head_weight()  # [H, V]
            head = nnx.eval_shape(lambda: Linear(1, 1, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0)))
            q, scale = quantize_weight(w, mode)
            head.kernel, head.scale, head.act_int8 = nnx.Param(q), nnx.data(nnx.Param(scale)), True
            m.head_int8 = nnx.data(head)
    return model


def draft_quantization(target: str | None, draft: str | None, int8_on_cpu: bool = True) -> str | None:
    """The draft's mode: --speculative-draft-model-quantization, else the target's, except on a CPU
    with the native int8 kernel, where the draft of a float or gguf target runs in w8a8_int8 (a
    draft is no GGUF file). A draft's products are few-row ones, which the kernel runs faster than
    XLA's float ones; the draft only proposes, so its rounding changes no output, and it proposed as
    well in int8 as in float32 on MT-bench (benchmarks/RESULTS.md). int8_on_cpu False (online
    training, which swaps float weights in; tensor parallelism): a float target's draft stays float;
    `unquant` asks for that too."""
    if draft:
        return draft
    if target == "gguf" or (target is None and int8_on_cpu):
        return "w8a8_int8" if native.available() else None
    return target


def weight_bytes(state) -> int:
    """Bytes of every array in a parameter state (memory reports and benchmarks)."""
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state) if hasattr(x, "dtype"))

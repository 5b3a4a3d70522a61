"""GGUF (llama.cpp) files as an HF-named source.

Tensors are dequantised with the `gguf` package; a tensor of a type it cannot dequantise is a
JaxspecError when the file opens. llama.cpp's converter permutes the rows of the Llama q/k
projections (interleaved RoPE pairs); `unpermute` undoes it. Qwen2 and Qwen3 files are not
permuted. Qwen3's per-head q/k norms are `blk.N.attn_q_norm` / `attn_k_norm`, and its head
dimension (which may differ from embedding_length / head_count) is `qwen3.attention.key_length`.
Qwen3-MoE (`qwen3moe`) adds a router and stacked experts per layer (convert/gguf_moe.py).
"""

from __future__ import annotations

import os

import numpy as np

from jaxspec.convert.gguf_moe import ExpertStacks, expert_names, moe_config
from jaxspec.convert.source import Source
from jaxspec.errors import JaxspecError

ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
MOE_ARCHS = ("qwen3moe",)

# GGUF per-layer name -> HF per-layer name.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


MOE_LAYER_NAMES = {"ffn_gate_inp": "mlp.gate"}  # the router (MoE architectures only)


def hf_name(gguf_name: str, moe: bool = False) -> str | None:
    """The HF name of a GGUF tensor other than an expert stack (None: not one jaxspec reads)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    names = {**LAYER_NAMES, **MOE_LAYER_NAMES} if moe else LAYER_NAMES
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation. w: [n_head * head_dim, ...] (weight or bias)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _head_dim(path: str, g) -> int | None:
    """The head dimension a file states (attention.key_length, else rope.dimension_count), or None."""
    key, value, rope = g("attention.key_length"), g("attention.value_length"), g("rope.dimension_count")
    if key and value and key != value:
        raise JaxspecError(f"{path}: key_length {key} != value_length {value} is not supported")
    if key and rope and key != rope:
        raise JaxspecError(f"{path}: RoPE over {rope} of {key} head dimensions (partial rotary) is not supported")
    return int(key or rope) if key or rope else None


def readable(qtype) -> bool:
    """Whether the `gguf` package dequantises tensors of GGUF type `qtype` (F32, F16 and the types
    of its quants table; a package without that table is trusted, and `get` reports a failure)."""
    from gguf import GGMLQuantizationType, quants

    table = getattr(quants, "_type_traits", None)
    return table is None or qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qtype in table


def check_types(path: str, tensors: dict) -> None:
    """A JaxspecError naming the tensors whose type the `gguf` package cannot dequantise."""
    bad = {n: t.tensor_type.name for n, t in tensors.items() if not readable(t.tensor_type)}
    if bad:
        kinds = sorted(set(bad.values()))
        raise JaxspecError(
            f"{path}: tensors of GGUF type {', '.join(kinds)} cannot be read (e.g. {next(iter(bad))}: "
            f"{bad[next(iter(bad))]}; {len(bad)} tensors): the gguf package has no dequantisation for "
            "that type; requantise the file to a type such as Q8_0, Q4_0, Q4_K or Q6_K (llama-quantize), or load "
            "the original HF directory"
        )


def gguf_config(path: str, reader, arch: str, tensors: dict) -> dict:
    """The HF config dict of a GGUF file of architecture `arch` from its metadata."""
    model_type, cls = ARCHS[arch]
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)

    def need(key: str) -> int:
        v = g(key)
        if v is None:
            raise JaxspecError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return int(v)

    heads, kv_heads = need("attention.head_count"), g("attention.head_count_kv")
    if "rope_freqs.weight" in tensors or g("rope.scaling.type") not in (None, "none"):
        raise JaxspecError(f"{path}: GGUF RoPE scaling is not supported; convert the original HF directory instead")
    n_vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "model_type": model_type,
        "architectures": [cls],
        "vocab_size": int(n_vocab),
        "hidden_size": need("embedding_length"),
        # a qwen3moe file whose every layer is sparse runs no dense MLP: its feed_forward_length is unused
        "intermediate_size": int(g("feed_forward_length") or 0) if arch in MOE_ARCHS else need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads or heads),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    head_dim = _head_dim(path, g)
    if head_dim:  # stated even where it is hidden / heads: HF's Qwen3Config defaults to 128 without it
        config["head_dim"] = head_dim
    if arch in MOE_ARCHS:
        config.update(moe_config(path, g, tensors, config["num_hidden_layers"]))
    return config


def open_gguf(path: str) -> Source:
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on bad files
        raise JaxspecError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise JaxspecError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHS)}")
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(path, reader, arch, tensors)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    moe = arch in MOE_ARCHS
    experts = expert_names(path, tensors, config["num_experts"]) if moe else {}
    stack_names = {gn for gn, _ in experts.values()}
    names = {}
    unknown = []
    for n in tensors:
        hn = hf_name(n, moe)
        if hn is not None:
            names[hn] = n
        elif n not in stack_names:
            unknown.append(n)
    if unknown:
        raise JaxspecError(f"{path}: unsupported GGUF tensors {unknown[:4]} (not a plain {arch} model?)")
    check_types(path, tensors)

    def dequantized(gname: str) -> np.ndarray:
        """GGUF tensor `gname` as float32 in numpy's order of its dimensions (GGUF lists them innermost first)."""
        t = tensors[gname]
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise JaxspecError(f"{path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from None
        want = tuple(int(x) for x in reversed(t.shape))
        return w if w.shape == want else w.reshape(want)

    stacks = ExpertStacks(dequantized)

    def get(name: str) -> np.ndarray:
        if name in experts:
            return stacks.expert(*experts[name])
        w = dequantized(names[name])
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = unpermute(w, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = unpermute(w, kv_heads)
        return w

    def blocks(name: str) -> np.ndarray:
        if name in experts:  # expert e's [rows, row bytes] of its stack
            gname, e = experts[name]
            return np.asarray(tensors[gname].data)[e]
        t = tensors[names[name]]
        raw = np.asarray(t.data)  # a view of the memory-mapped file, [rows, row bytes]
        if arch == "llama" and ".self_attn.q_proj." in name:
            raw = unpermute(raw, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            raw = unpermute(raw, kv_heads)
        return raw

    def load_tokenizer():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
            )
        except Exception as e:
            raise JaxspecError(f"cannot build a tokenizer from {path}: {type(e).__name__}: {e}") from None

    types = {hn: tensors[gn].tensor_type.name for hn, gn in names.items()}
    types.update({hn: tensors[gn].tensor_type.name for hn, (gn, _) in experts.items()})
    return Source(path, "gguf", config, list(names) + list(experts), get, load_tokenizer, types, blocks)

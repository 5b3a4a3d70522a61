"""GGUF (llama.cpp) files as an HF-named source.

Tensors are dequantised with the `gguf` package. llama.cpp's converter permutes the rows of the
Llama q/k projections (interleaved RoPE pairs); `unpermute` undoes it. Qwen2 and Qwen3 files are
not permuted. Qwen3's per-head q/k norms are `blk.N.attn_q_norm` / `attn_k_norm`, and its head
dimension (which may differ from embedding_length / head_count) is `qwen3.attention.key_length`.
"""

from __future__ import annotations

import os

import numpy as np

from jaxspec.convert.source import Source
from jaxspec.errors import JaxspecError

ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

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


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
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
    model_type, cls = ARCHS[arch]
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    heads, kv_heads = g("attention.head_count"), g("attention.head_count_kv")
    kv_heads = kv_heads or heads
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors or g("rope.scaling.type") not in (None, "none"):
        raise JaxspecError(f"{path}: GGUF RoPE scaling is not supported; convert the original HF directory instead")
    n_vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "model_type": model_type,
        "architectures": [cls],
        "vocab_size": int(n_vocab),
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
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
    names = {}
    unknown = []
    for n in tensors:
        hn = hf_name(n)
        if hn is None:
            unknown.append(n)
        else:
            names[hn] = n
    if unknown:
        raise JaxspecError(f"{path}: unsupported GGUF tensors {unknown[:4]} (not a plain {arch} model?)")

    def get(name: str) -> np.ndarray:
        t = tensors[names[name]]
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise JaxspecError(f"{path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from None
        want = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        if w.shape != want:
            w = w.reshape(want)
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = unpermute(w, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = unpermute(w, kv_heads)
        return w

    def blocks(name: str) -> np.ndarray:
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
    return Source(path, "gguf", config, list(names), get, load_tokenizer, types, blocks)

"""MTP (multi-token prediction) modules used as drafts through the EAGLE path (SGLang: NEXTN = EAGLE).

Two public layouts, on Llama / Qwen2-style decoder layers (no MLA, no MoE):

DeepSeek NextN (`num_nextn_predict_layers: 1`), tensors under `model.layers.{K}.` where K is the
target's num_hidden_layers (or 0 in a draft-only export whose num_hidden_layers is 1):
    x   = eh_proj(concat(enorm(embed(x_{p+1})), hnorm(h_p)))        eh_proj: [H, 2H], no bias
    y   = decoder_layer(x)                                          (input_layernorm, self_attn, mlp)
    out = shared_head.norm(y)    -> logits through the target's LM head; `out` is fed back
`embed_tokens` and `shared_head.head` may be present; the target's own embedding / LM head are used.

MiMo (`MiMoForCausalLM`), tensors under `model.mtp_layers.0.`:
    e   = embed(x_{p+1}), zeroed where the position is 0
    x   = input_proj(concat(hidden_layernorm(h_p), token_layernorm(e)))   (hidden first)
    y   = decoder_layer(x)
    out = final_layernorm(y)     -> logits through the target's LM head; `out` is fed back

h_p is the target's final hidden after its final norm (what the EAGLE path already passes).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig, rope_inv_freq
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import DecoderLayer, Linear, RMSNorm

MTP_KINDS = ("NEXTN", "MIMO")


class SharedHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class NextNHead(nnx.Module):
    kind = "NEXTN"

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * h, h, bias=False, dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(cfg, dtype, rngs)
        self.shared_head = SharedHead(cfg, dtype)

    def __call__(self, embeds, hidden, positions, cache: KVCache, local_mask=None, offset=0, backend="xla", layer=0):
        """embeds, hidden: [B, T, H] -> (normed output for the LM head, the same to feed back, cache).
        layer: the cache layer holding this module's KV (several modules share one cache)."""
        x = self.eh_proj(jnp.concatenate([self.enorm(embeds), self.hnorm(hidden.astype(embeds.dtype))], -1))
        inv_freq = jnp.asarray(rope_inv_freq(self.cfg))
        y, cache = self.layer(x, positions, inv_freq, cache, layer, local_mask, offset, backend)
        out = self.shared_head.norm(y)
        return out, out, cache


class MiMoMTPHead(nnx.Module):
    kind = "MIMO"

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.hidden_size
        self.hidden_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.token_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.input_proj = Linear(2 * h, h, bias=False, dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(cfg, dtype, rngs)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)

    def __call__(self, embeds, hidden, positions, cache: KVCache, local_mask=None, offset=0, backend="xla", layer=0):
        embeds = jnp.where((positions == 0)[..., None], 0, embeds)
        x = self.input_proj(
            jnp.concatenate([self.hidden_layernorm(hidden.astype(embeds.dtype)), self.token_layernorm(embeds)], -1)
        )
        inv_freq = jnp.asarray(rope_inv_freq(self.cfg))
        y, cache = self.layer(x, positions, inv_freq, cache, layer, local_mask, offset, backend)
        out = self.final_layernorm(y)
        return out, out, cache


def mtp_layout(config: dict, names) -> tuple[str, str] | None:
    """(kind, tensor prefix) of the first MTP module a checkpoint carries, or None."""
    layouts = mtp_layouts(config, names)
    return None if layouts is None else (layouts[0], layouts[1][0])


def mtp_layouts(config: dict, names) -> tuple[str, list[str]] | None:
    """(kind, tensor prefix of each MTP module, in drafting order) of a checkpoint, or None.

    NEXTN: `model.layers.{num_hidden_layers + i}.eh_proj.weight` for module i (layers 0, 1, ... in
    a draft-only export whose num_hidden_layers is 1), at most num_nextn_predict_layers of them;
    MIMO: `model.mtp_layers.{i}.input_proj.weight`. Modules count from the first one up to a gap."""
    names = set(names)

    def run(prefix, first: int, marker: str, limit: int) -> list[str]:
        out: list[str] = []
        while len(out) < limit and f"{prefix}{first + len(out)}.{marker}" in names:
            out.append(f"{prefix}{first + len(out)}.")
        return out

    if config.get("num_nextn_predict_layers"):
        n, count = config["num_hidden_layers"], int(config["num_nextn_predict_layers"])
        for k in ([0] if n == 1 else []) + [n]:
            found = run("model.layers.", k, "eh_proj.weight", count)
            if found:
                return "NEXTN", found
    found = run("model.mtp_layers.", 0, "input_proj.weight", 1 << 10)
    return ("MIMO", found) if found else None


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """True for MTP tensors inside a target checkpoint (skipped when loading the target itself)."""
    if name.startswith("model.mtp_layers."):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= num_layers


def mtp_config(config: dict) -> ModelConfig:
    """ModelConfig of the MTP decoder layer: the target's own layer shape."""
    d = {**config, "num_hidden_layers": 1}
    mt = d.get("model_type")
    if mt == "mimo" or mt == "qwen2":
        d.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    else:
        d.update(model_type="llama", architectures=["LlamaForCausalLM"])
    if d.get("n_routed_experts") or d.get("kv_lora_rank"):
        raise JaxspecError("MTP drafts are supported on Llama / Qwen2-style layers only (no MLA / MoE)")
    return ModelConfig.from_hf(d)


def mtp_key(prefix: str):
    """NNX path -> (checkpoint key, transpose?) for an MTP head whose tensors sit under `prefix`."""

    def key(path: tuple) -> tuple[str, bool]:
        parts = [str(p) for p in path]
        transpose = parts[-1] == "kernel"
        if transpose:
            parts[-1] = "weight"
        if parts[0] == "layer":
            parts = parts[1:]  # the decoder layer's tensors sit directly under the prefix
        return prefix + ".".join(parts), transpose

    return key


def build_mtp(kind: str, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    return NextNHead(cfg, dtype, rngs=rngs) if kind == "NEXTN" else MiMoMTPHead(cfg, dtype, rngs=rngs)


class MTPStack(nnx.Module):
    """Several MTP modules of one checkpoint, in drafting order (multi-layer MTP: module j drafts
    the j-th token after the root; speculative/proposers/eagle.py MultiLayerMTPProposer)."""

    def __init__(self, heads: list):
        self.heads = nnx.List(heads)

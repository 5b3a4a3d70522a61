"""llama.cpp's `qwen3moe` GGUF files: their mixture-of-experts metadata and stacked expert tensors,
seen as a Qwen3-MoE HF checkpoint's (convert/gguf_llama.py reads the rest of the file).

Metadata (prefix `qwen3moe.`):
  expert_count (E), expert_used_count (k)      -> num_experts, num_experts_per_tok
  expert_feed_forward_length (I)               -> moe_intermediate_size (llama.cpp's fallback without
                                                  it, feed_forward_length / k, is kept)
  expert_weights_norm                          -> norm_topk_prob; llama.cpp's converter does not write
                                                  it and llama.cpp renormalises qwen3moe's top k
                                                  weights always, so it defaults to true
  expert_gating_func, expert_weights_scale     when present: softmax, and no scale (1) only
Tensors of sparse layer N (GGUF lists dimensions innermost first; shapes here are numpy's):
  blk.N.ffn_gate_inp.weight   [E, H]     the router, HF model.layers.N.mlp.gate.weight
  blk.N.ffn_gate_exps.weight  [E, I, H]  expert e's row block: HF model.layers.N.mlp.experts.e.gate_proj.weight
  blk.N.ffn_up_exps.weight    [E, I, H]  ... experts.e.up_proj.weight
  blk.N.ffn_down_exps.weight  [E, H, I]  ... experts.e.down_proj.weight
llama.cpp's qwen3moe makes every layer sparse; a layer that holds ffn_gate / ffn_up / ffn_down instead
of a router is read as dense (HF mlp_only_layers). Shared experts (ffn_*_shexp, qwen2moe's) are not
part of the architecture and are reported as unsupported tensors.

The experts are presented under the per-expert names of released checkpoints (what `jaxspec convert`
writes, and what models/params.py `stack_experts` stacks again for the model): each stack is
dequantized once (`ExpertStacks`) and its experts are slices of it.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxspec.errors import JaxspecError

# GGUF expert stack -> HF per-expert projection
EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")
SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def moe_config(path: str, g: Callable[..., Any], tensors: dict, layers: int) -> dict[str, Any]:
    """The HF Qwen3-MoE config fields of a qwen3moe file (module docstring); g(key, default) reads
    `qwen3moe.<key>`, `tensors` maps GGUF names to the reader's tensors."""
    experts, used = g("expert_count"), g("expert_used_count")
    if not experts or not used:
        raise JaxspecError(f"{path}: a qwen3moe file needs qwen3moe.expert_count and qwen3moe.expert_used_count")
    inter = g("expert_feed_forward_length") or int(g("feed_forward_length") or 0) // int(used)
    gating, scale = g("expert_gating_func"), g("expert_weights_scale")
    if gating not in (None, SOFTMAX_GATING):
        raise JaxspecError(f"{path}: qwen3moe.expert_gating_func {gating} is not softmax; jaxspec routes by softmax")
    if scale not in (None, 0.0, 1.0):
        raise JaxspecError(
            f"{path}: qwen3moe.expert_weights_scale {scale} is not supported (experts' weights unscaled)"
        )
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(used),
        moe_intermediate_size=int(inter),
        norm_topk_prob=bool(g("expert_weights_norm", True)),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    )


def expert_names(path: str, tensors: dict, experts: int) -> dict[str, tuple[str, int]]:
    """HF per-expert name -> (GGUF stack name, expert index) for every expert stack of the file;
    a stack whose outer dimension is not `experts` is a JaxspecError."""
    out = {}
    for name, t in tensors.items():
        m = EXPERT_TENSOR.match(name)
        if not m:
            continue
        dims = tuple(int(x) for x in reversed(t.shape))  # [E, rows, cols]
        if len(dims) != 3 or dims[0] != experts:
            raise JaxspecError(
                f"{path}: {name} has shape {list(dims)}; a qwen3moe expert stack is [{experts} experts, rows, columns]"
            )
        for e in range(experts):
            out[f"model.layers.{m[1]}.mlp.experts.{e}.{EXPERT_PARTS[m[2]]}.weight"] = (name, e)
    return out


class ExpertStacks:
    """Dequantized expert stacks [E, rows, cols] float32 by GGUF name, the last `keep` kept: loading
    asks for a layer's experts one after another (gate and up of expert 0, of expert 1, ..., then
    the down projections), so each stack is dequantized once. read(name) dequantizes one."""

    def __init__(self, read: Callable[[str], np.ndarray], keep: int = 3):
        self.read, self.keep = read, keep
        self.stacks: OrderedDict[str, np.ndarray] = OrderedDict()

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e of stack `name`: [rows, cols] float32 (a copy, so no stack outlives its use)."""
        if name not in self.stacks:
            self.stacks[name] = self.read(name)
            while len(self.stacks) > self.keep:
                self.stacks.popitem(last=False)
        return np.array(self.stacks[name][e])

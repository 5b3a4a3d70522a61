"""Model configuration: a frozen, hashable view of an HF `config.json`.

`ModelConfig` holds only static fields, so it can be passed to `jax.jit` as a static argument.
Both config dialects are read: transformers < 5 (`rope_theta`, `rope_scaling`) and
transformers >= 5 (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

import numpy as np

from jaxspec.args import SpeculativeArgs
from jaxspec.errors import JaxspecError

# model_type -> architectures class name we accept for it.
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",  # dense Qwen3: per-head RMSNorm on q and k (qk_norm), no q/k/v bias
    "qwen3_moe": "Qwen3MoeForCausalLM",  # Qwen3 attention; sparse MoE blocks (models/moe.py) in some layers
    "mimo": "MiMoForCausalLM",  # Qwen2 layers (+ MTP layers, used as a draft: models/mtp.py)
}
QWEN2_LIKE = ("qwen2", "mimo")  # q/k/v always carry a bias, o_proj never
SUPPORTED_ROPE = ("default", "linear", "llama3")
FULL = frozenset({"full_attention"})  # the one layer type (HF config `layer_types`) read
# EAGLE draft heads' architectures class name -> speculative algorithm (models/eagle.py builds them)
EAGLE_ARCHS = {"LlamaForCausalLMEagle": "EAGLE", "LlamaForCausalLMEagle3": "EAGLE3"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # ("linear", (("factor", 2.0),)) style: a hashable copy of the rope scaling dict.
    rope_type: str = "default"
    rope_params: tuple = ()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, or Llama attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama attention_bias only)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm [head_dim] on each query and key head before RoPE (Qwen3)
    sliding_window: int | None = None
    # Qwen3-MoE (num_experts > 0): a layer i is sparse (models/moe.py) unless i is in mlp_only_layers
    # or (i + 1) % decoder_sparse_step != 0; its experts are SwiGLU MLPs of moe_intermediate_size,
    # the router's top num_experts_per_tok probabilities weigh them (renormalised if norm_topk_prob)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has a sparse MoE block instead of a dense MLP."""
        step_ok = self.decoder_sparse_step > 0 and (layer + 1) % self.decoder_sparse_step == 0
        return self.num_experts > 0 and layer not in self.mlp_only_layers and step_ok

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Builds a config from an HF config dict; raises JaxspecError if unsupported."""
        mt = str(d.get("model_type"))
        archs = d.get("architectures") or [SUPPORTED.get(mt, "?")]
        if mt not in SUPPORTED:
            raise JaxspecError(
                f"unsupported architecture: model_type={mt!r} architectures={archs}; "
                f"supported: {', '.join(sorted(SUPPORTED))}"
            )
        if archs[0] != SUPPORTED[mt]:
            raise JaxspecError(f"unsupported architecture {archs[0]!r} (expected {SUPPORTED[mt]} for {mt})")
        hidden = d["hidden_size"]
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise JaxspecError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = d.get("head_dim") or hidden // heads
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling")
        if scaling:
            rope.update(scaling)
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE:
            raise JaxspecError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE)}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise JaxspecError("partial_rotary_factor != 1 is not supported")
        rope_params = tuple(sorted((k, v) for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")))
        sliding = None
        if mt == "mistral":
            sliding = d.get("sliding_window")
        elif mt in ("qwen2", "qwen3", "qwen3_moe") and (
            d.get("use_sliding_window") or set(d.get("layer_types") or ()) - FULL
        ):
            raise JaxspecError(f"{archs[0]} with sliding-window layers (use_sliding_window=true) is not supported")
        attn_bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if d.get("hidden_act", "silu") != "silu":
            raise JaxspecError(f"unsupported hidden_act {d.get('hidden_act')!r} (only silu)")
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_type=rope_type,
            rope_params=rope_params,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=(mt in QWEN2_LIKE) or attn_bias,
            o_bias=attn_bias and mt not in QWEN2_LIKE,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            sliding_window=sliding,
            **(moe_fields(d, archs[0]) if mt == "qwen3_moe" else {}),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str) -> ModelConfig:
        return cls.from_hf(read_json(path))


def moe_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's MoE fields from a Qwen3-MoE HF config (transformers >= 5 writes num_experts as
    num_local_experts); JaxspecError for what jaxspec does not run."""
    experts = d.get("num_experts", d.get("num_local_experts"))
    k, inter = d.get("num_experts_per_tok"), d.get("moe_intermediate_size")
    if not experts or not k or not inter:
        raise JaxspecError(f"{arch} needs num_experts, num_experts_per_tok and moe_intermediate_size > 0")
    if k > experts:
        raise JaxspecError(f"{arch}: num_experts_per_tok={k} is more than num_experts={experts}")
    if d.get("shared_expert_intermediate_size"):
        raise JaxspecError(f"{arch} with a shared expert (shared_expert_intermediate_size) is not supported")
    step = int(d.get("decoder_sparse_step") or 1)
    if step < 1:
        raise JaxspecError(f"{arch}: decoder_sparse_step={step} must be >= 1")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(k),
        moe_intermediate_size=int(inter),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(sorted(int(i) for i in d.get("mlp_only_layers") or ())),
    )


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        raise JaxspecError(f"missing file: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise JaxspecError(f"{path} is not valid JSON: {e}") from None


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2] (float32), with the config's scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    p = dict(cfg.rope_params)
    if cfg.rope_type == "linear":
        inv = inv / p["factor"]
    elif cfg.rope_type == "llama3":
        factor = p["factor"]
        lo, hi = p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        scaled = np.where(wavelen > old_ctx / lo, inv / factor, inv)
        t = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = np.where(mid, (1 - t) * scaled / factor + t * scaled, scaled)
    return inv.astype(np.float32)


# ---- speculative decoding ------------------------------------------------------------------------

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
NGRAM_DEFAULT_DRAFT_TOKENS = 12  # SGLang's default speculative_num_draft_tokens for NGRAM


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """SGLang's `--speculative-ngram-*` flags (defaults: jaxspec.args.SpeculativeArgs), validated."""

    min_match_window_size: int
    max_match_window_size: int
    min_bfs_breadth: int
    max_bfs_breadth: int
    match_type: str  # BFS | PROB
    branch_length: int
    capacity: int
    force_greedy_verify: bool

    @classmethod
    def from_args(cls, a: SpeculativeArgs) -> NgramConfig:
        a._validate_ngram()
        return cls(
            a.speculative_ngram_min_match_window_size,
            a.speculative_ngram_max_match_window_size,
            a.speculative_ngram_min_bfs_breadth,
            a.speculative_ngram_max_bfs_breadth,
            str(a.speculative_ngram_match_type).upper(),
            a.speculative_ngram_branch_length,
            a.speculative_ngram_capacity,
            a.ngram_force_greedy_verify,
        )


def tree_capacity(num_steps: int, topk: int) -> int:
    """Nodes an EAGLE-2 draft tree holds: the root, topk depth-1 candidates, and topk^2 more for
    each further step (each of the topk beams proposes topk children); verification picks the best
    num_draft_tokens - 1 of them."""
    return 1 + topk + (num_steps - 1) * topk * topk


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """SGLang's `--speculative-*` flags, resolved against the target and validated.

    `num_steps` draft forwards build a tree of `num_draft_tokens` (N) nodes, root included, from the
    `eagle_topk` best children per step. Static: it is a jit static argument."""

    algorithm: str = "NONE"
    draft_model_path: str | None = None
    num_steps: int = 0
    eagle_topk: int = 0
    num_draft_tokens: int = 0
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0
    token_map: str | None = None
    ngram: NgramConfig | None = None  # NGRAM only
    # --speculative-suffix-draft-tokens: text-match candidates merged into a draft model's tree
    # (speculative/proposers/suffix.py): up to suffix_nodes nodes below the root, found as NGRAM's
    # are (suffix: most frequent first, matches of at least --speculative-suffix-min-match tokens)
    suffix: NgramConfig | None = None
    suffix_nodes: int = 0
    adaptive: bool = False  # speculative/adaptive.py: speculate or not, chosen per block of rounds
    # sampled requests draw one path of drafts from the draft distribution and accept it by
    # min(1, p / q) (speculative/tree.py, verify.py); False: the target-only rule throughout
    draft_sampling: bool = True
    # --enable-multi-layer-eagle: an MTP checkpoint's layers draft one step each (a chain, topk 1)
    multi_layer: bool = False
    # --speculative-attention-mode: the attention path of verification and the draft's extend
    # (jaxspec/attention.py: "prefill" one pass, "decode" the prefix split from the local region)
    attention_mode: str = "prefill"
    # a shipped draft's top-k for rounds that sample, where that was measured faster than eagle_topk
    # (for_kind); None: eagle_topk for every round
    sampled_topk: int | None = None

    @property
    def enabled(self) -> bool:
        return self.algorithm != "NONE"

    @property
    def is_eagle(self) -> bool:
        return self.algorithm in ("EAGLE", "EAGLE3")

    def without_text(self) -> SpecConfig:
        """The draft model's tree alone, without text-match candidates."""
        return dataclasses.replace(self, suffix=None, suffix_nodes=0)

    @property
    def suffix_depth(self) -> int:
        """The deepest text-match candidate below the root (0 without them)."""
        if self.suffix is None:
            return 0
        return max(1, min(self.suffix_nodes, self.suffix.branch_length - 1))

    @property
    def depth(self) -> int:
        """The verified tree's depth bound: accepted drafts per round are at most this (num_steps, or
        deeper text-match candidates)."""
        return max(self.num_steps, self.suffix_depth)

    @property
    def tree_nodes(self) -> int:
        """Nodes verified per round, root included: the draft's num_draft_tokens plus the text-match
        candidates merged into its tree."""
        return self.num_draft_tokens + self.suffix_nodes

    @property
    def text_match(self) -> NgramConfig | None:
        """The matching of the text shared by requests (NGRAM's, or the merged text-match candidates')."""
        return self.ngram if self.ngram is not None else self.suffix

    @property
    def scratch_tokens(self) -> int:
        """KV-cache columns a round writes past a request's last token: the verified tree
        (tree_nodes) plus the draft's own tree steps (num_steps * eagle_topk), plus 2 for the
        bonus token and the next round's root."""
        return 0 if not self.enabled else self.tree_nodes + self.num_steps * self.eagle_topk + 2

    def for_kind(self, sampled: bool) -> SpecConfig:
        """The tree shape rounds of this kind run: with `sampled` (some row draws) and drafts drawn
        from the draft distribution, sampled_topk children per node where it is set. A sibling of
        the drawn child is tried only after that child's rejection, against the residual
        distribution max(p - q, 0), where the draft's next most likely token rarely wins; so a
        chain can pay there where greedy rounds gain from the tree. Same num_steps (the state's
        histogram and the draft's depth), never more nodes (the KV scratch is the configured shape's)."""
        k = self.sampled_topk
        if not sampled or k is None or k == self.eagle_topk or not self.draft_sampling:
            return self
        n = min(self.num_draft_tokens, tree_capacity(self.num_steps, k))
        return dataclasses.replace(self, eagle_topk=k, num_draft_tokens=n, sampled_topk=None)

    @classmethod
    def resolve(
        cls,
        args: SpeculativeArgs | None = None,
        target: ModelConfig | None = None,
        bundled: tuple[str, str, tuple | None] | None = None,
        warn: bool = True,
    ) -> SpecConfig:
        """The flags applied to a target. bundled: (algorithm, draft path, tree shape or None: a
        jaxspec.drafts.ShippedTree or (num_steps, eagle_topk, num_draft_tokens)) the
        target supplies (a draft shipped for it in jaxspec.drafts, or its own MTP module). It is used
        when the algorithm is unset (None), or is that algorithm without a draft path; "NONE" turns it
        off. Its tree shape, if any, replaces the auto defaults."""
        log = logging.getLogger("jaxspec")
        a = args or SpeculativeArgs()
        a.validate()
        algo = a.algorithm
        if algo is None:  # unset: the target's shipped draft, if any, with the flags checked for it
            algo = bundled[0] if bundled else "NONE"
            if algo != "NONE":
                dataclasses.replace(a, speculative_algorithm=algo).validate()
        if algo == "NONE":
            return cls()
        single, acc = float(a.speculative_accept_threshold_single), float(a.speculative_accept_threshold_acc)
        num_steps, eagle_topk, num_draft_tokens = a.tree_knobs
        if algo == "NGRAM":
            # No draft model; the tree comes from n-gram matches. Depth is bounded by N - 1, which
            # plays num_steps' part (verification walk, histogram); topk has no meaning here.
            n = NGRAM_DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
            if warn and (num_steps is not None or eagle_topk is not None):
                log.warning(
                    "speculative_num_steps / speculative_eagle_topk are ignored for NGRAM (the tree has speculative_num_draft_tokens nodes)"
                )
            return cls(
                "NGRAM",
                None,
                n - 1,
                1,
                n,
                single,
                acc,
                ngram=NgramConfig.from_args(a),
                attention_mode=a.speculative_attention_mode,
            )
        draft_model_path, shipped_tree, sampled_topk = a.speculative_draft_model_path, None, None
        if draft_model_path is None and bundled and bundled[0] == algo:
            draft_model_path, shipped_tree = bundled[1], bundled[2]
        if draft_model_path is None:
            hint = " (or a target checkpoint that carries an MTP module)" if algo == "EAGLE" else ""
            raise JaxspecError(f"speculative_algorithm={algo} needs speculative_draft_model_path{hint}")
        if num_steps is None or eagle_topk is None or num_draft_tokens is None:  # validate(): all three or none
            if shipped_tree is not None:
                num_steps, eagle_topk, num_draft_tokens = shipped_tree[:3]
                k = getattr(shipped_tree, "sampled_eagle_topk", None)
                sampled_topk = k if k is not None and k < eagle_topk else None  # never more nodes
            else:
                llama = target is not None and target.model_type in LLAMA_FAMILY and algo != "STANDALONE"
                tree = llama and not a.enable_multi_layer_eagle  # multi-layer MTP drafts a chain
                num_steps, eagle_topk, num_draft_tokens = (5, 4, 8) if tree else (3, 1, 4)
        cap = tree_capacity(num_steps, eagle_topk)
        if eagle_topk == 1 and num_draft_tokens != cap:
            if warn:
                msg = "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 = %d when speculative_eagle_topk == 1"
                log.warning(msg, cap)
            num_draft_tokens = cap
        elif num_draft_tokens > cap:
            if warn:
                log.warning(
                    "speculative_num_draft_tokens=%d is more than the %d nodes a tree of speculative_num_steps=%d and "
                    "speculative_eagle_topk=%d holds (1 + topk + (num_steps - 1) * topk^2); lowered to %d",
                    num_draft_tokens,
                    cap,
                    num_steps,
                    eagle_topk,
                    cap,
                )
            num_draft_tokens = cap
        # unset: on for a shipped draft run at its shipped shape; a shape the user set is the shape run
        explicit = a.tree_knobs[0] is not None
        # unset with text-match candidates: off (measured: its trials of four candidates cost more
        # than its choice won back, on code edits and on MT-bench alike)
        quiet = shipped_tree is not None and not explicit and not a.speculative_suffix_draft_tokens
        adaptive = quiet if a.speculative_adaptive is None else a.speculative_adaptive
        suffix = None
        if a.speculative_suffix_draft_tokens:
            text = NgramConfig.from_args(a)
            lo = max(text.min_match_window_size, a.speculative_suffix_min_match)
            suffix = dataclasses.replace(text, match_type="PROB", min_match_window_size=lo)
        return cls(
            algo,
            draft_model_path,
            num_steps,
            eagle_topk,
            num_draft_tokens,
            single,
            acc,
            a.speculative_token_map,
            adaptive=adaptive,
            multi_layer=bool(a.enable_multi_layer_eagle),
            attention_mode=a.speculative_attention_mode,
            sampled_topk=sampled_topk,
            suffix=suffix,
            suffix_nodes=a.speculative_suffix_draft_tokens if suffix is not None else 0,
        )

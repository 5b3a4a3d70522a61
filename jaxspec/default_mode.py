"""How a target runs when the user leaves it to jaxspec: its quantization and its draft.

Decided here, and only here, for `jaxspec.Engine()`, `jaxspec serve`, `generate` and `bench`.

**A GGUF file runs at its own quantization on a CPU.** A GGUF target (the default model,
SmolLM2-135M-Instruct Q4_1, included) is served as `--quantization gguf` (jaxspec/gguf.py: the
file's Q4_0 / Q4_1 / Q8_0 blocks as stored, multiplied by a native kernel) when the user asked for
neither a quantization nor a dtype (`--dtype auto`, the default), on the CPU, on one device. It is
the fastest faithful way to run the file there: the file's own weights, as llama.cpp runs them; the
default model decodes at 2.75x its float32 reading with the shipped draft on a 2-core CPU
(benchmarks/RESULTS.md, "The default on a CPU: the GGUF served as it is").
`--dtype float32` reads the file as float32 instead, the reading checked token for token against
HF transformers.

Everything else keeps float32 (or the checkpoint's own quantization): float checkpoints, GPUs (the
kernel is XLA:CPU code), `--tp-size` > 1, online draft training (the head learns from the float
target's features), a machine where the kernel cannot be built, and a GGUF file holding other block
types (K-quants, say), which only the float32 reading serves.

**The draft follows the mode.** The draft shipped for a target speculates by default, except under
`gguf`: there a round of the shipped EAGLE-3 head costs about two plain steps for fewer than two
tokens, so adaptive speculation only ties plain decoding (by running plain steps) and static rounds
lose; the target decodes plainly, lighter at the same speed, unless a draft is named
(`--speculative-algorithm EAGLE3`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxspec import compile_target


def may_keep_gguf_blocks(args: Any) -> bool:
    """Whether a GGUF target runs at its own quantization, if its tensors allow it (`gguf_default`):
    neither --quantization nor a dtype asked for, the CPU, one device, no online draft training, and
    the native kernel built. args: ModelArgs / EngineArgs (online training: EngineArgs only)."""
    if args.quantization is not None or args.dtype not in (None, "auto"):
        return False
    if args.tp_size != 1 or getattr(args, "speculative_online_train", False):
        return False
    if compile_target.platform() != "cpu":  # a GPU, or programs built for one: float32 as before
        return False
    from jaxspec import native

    return native.gguf_unavailable() is None  # asked only on a CPU: the first call builds the kernel


def gguf_default(src) -> str | None:
    """The quantization an opened checkpoint `src` runs in where `may_keep_gguf_blocks` holds: "gguf"
    for a GGUF file whose every tensor the kernel reads, else None (float32, or the checkpoint's own
    quantization)."""
    from jaxspec import gguf

    return "gguf" if src.kind == "gguf" and not gguf.unsupported_kinds(src.types) else None


def shipped_draft_by_default(quantization: str | None) -> bool:
    """Whether the draft shipped for a target speculates when no --speculative-algorithm is given:
    not under gguf (module docstring)."""
    return quantization != "gguf"


def target_mode(eng) -> str:
    """What an Engine's target runs in, for start-up messages (`jaxspec serve`, `make chat`), saying
    why when it is the CPU's default for a GGUF file."""
    if eng.quantization == "gguf" and eng.args.quantization is None:
        return "gguf (a GGUF file's own blocks: on a CPU the default, and the fastest; --dtype float32 for float32)"
    return eng.quantization or np.dtype(eng.dtype).name

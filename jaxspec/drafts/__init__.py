"""Draft heads shipped inside the package, and the rule that picks one for a target.

Each subdirectory is a draft in the public layout (config.json + model.safetensors, as SGLang
loads it) plus `target.json`, which names the target it was trained for and the shape that target
must have. A draft is picked when `speculative_algorithm` is left unset (or is EAGLE3 without a
draft path) and the loaded target matches; `speculative_algorithm="NONE"` turns speculation off.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))


def bundled_drafts() -> dict[str, dict]:
    """{draft directory: its target.json} for every shipped draft."""
    out = {}
    for name in sorted(os.listdir(HERE)):
        meta = os.path.join(HERE, name, "target.json")
        if os.path.exists(meta) and os.path.exists(os.path.join(HERE, name, "model.safetensors")):
            with open(meta) as f:
                out[os.path.join(HERE, name)] = json.load(f)
    return out


class ShippedTree(NamedTuple):
    """The tree shape measured best for a shipped draft on one platform (target.json "tree").
    sampled_eagle_topk: the top-k of rounds that sample (drafts drawn from the draft distribution),
    where that measured better than eagle_topk; None: eagle_topk there too."""

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    sampled_eagle_topk: int | None = None


def bundled_draft_for(
    target_path: str | None, target_cfg, algorithm: str | None = None, platform: str | None = None
) -> tuple[str, str, ShippedTree | None] | None:
    """(algorithm, draft directory, tree shape) shipped for this target, or None.

    algorithm: None picks the target's default draft (target.json "default": true); "EAGLE3" or
    "EAGLE" picks the shipped head of that kind. platform: "cpu" or "gpu" (default: JAX's backend).

    The tree shape (ShippedTree) is the one measured best for this draft on this platform
    (target.json "tree": {"cpu": {...}, "gpu": {...}}); it replaces SGLang's per-architecture auto
    defaults when the user sets none of the three knobs. None means the usual auto defaults.

    target_path: where the target was loaded from; target_cfg: its ModelConfig. A draft matches
    when the target's directory name carries the draft's target name and the shapes agree, so a
    fine-tuned model of another shape never gets a head it was not trained for."""
    if not target_path:
        return None
    base = os.path.basename(os.path.normpath(target_path)).lower()
    for path, meta in bundled_drafts().items():
        if meta["target"].lower() not in base or not all(getattr(target_cfg, k) == v for k, v in meta["shape"].items()):
            continue
        wanted = meta["algorithm"] == algorithm if algorithm is not None else meta.get("default", False)
        if not wanted:
            continue
        tree = meta.get("tree", {}).get(platform or _platform())
        return (
            meta["algorithm"],
            path,
            None
            if tree is None
            else ShippedTree(
                tree["num_steps"], tree["eagle_topk"], tree["num_draft_tokens"], tree.get("sampled_eagle_topk")
            ),
        )
    return None


def _platform() -> str:
    from jaxspec import compile_target

    return "cpu" if compile_target.platform() == "cpu" else "gpu"

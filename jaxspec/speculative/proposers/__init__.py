"""Draft proposers. One file per method; each implements the `Proposer` protocol in `base.py`."""

from __future__ import annotations

from jaxspec.speculative.proposers.base import DraftState, Proposer
from jaxspec.speculative.proposers.eagle import load_eagle
from jaxspec.speculative.proposers.ngram import load_ngram
from jaxspec.speculative.proposers.standalone import load_standalone


def load_proposer(spec, target, dtype, progress: bool = True):
    """-> (Proposer, draft params pytree) for `spec.algorithm`; `target` is the LoadedModel."""
    if spec.algorithm == "STANDALONE":
        return load_standalone(spec, target, dtype, progress)
    if spec.algorithm in ("EAGLE", "EAGLE3"):
        return load_eagle(spec, target, dtype, progress)
    if spec.algorithm == "NGRAM":
        return load_ngram(spec, target)
    raise ValueError(f"no proposer for {spec.algorithm}")


__all__ = ["DraftState", "Proposer", "load_proposer"]

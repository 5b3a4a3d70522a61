"""`Source`: a checkpoint seen as HF-named numpy tensors, an HF config and a tokenizer loader.

A leaf of the `convert` package (it imports only numpy, the standard library and jaxspec.errors):
the readers (`convert.sources`, `convert.gguf_llama`) build Sources, and everything that loads
weights consumes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxspec.errors import JaxspecError


@dataclasses.dataclass
class Source:
    path: str
    kind: str  # "hf" | "gguf" | "eagle"
    config: dict  # HF config.json content
    names: list[str]  # HF tensor names
    get: Callable[[str], np.ndarray]  # name -> numpy array (float)
    load_tokenizer: Callable[[], Any]  # -> transformers tokenizer (None: the source has none)
    # GGUF files only: each tensor's GGUF type name (Q4_1, F32, ...) and its raw blocks, uint8
    # [rows, row bytes] as the file stores them (q/k rows already in HF order), for --quantization gguf
    types: dict[str, str] = dataclasses.field(default_factory=dict)
    blocks: Callable[[str], np.ndarray] | None = None

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        for n in self.names:
            yield n, self.get(n)


def hf_tokenizer(path: str):
    """The transformers tokenizer saved in directory (or hub id) `path`."""
    from transformers import AutoTokenizer  # heavy; only paths that load a tokenizer pay for it

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        raise JaxspecError(
            f"cannot load a tokenizer from {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None

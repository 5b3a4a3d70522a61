"""Weight conversion: HF directories and GGUF files -> jaxspec checkpoints.

`open_source(path)` reads any supported source as HF-named float tensors plus an HF config dict
and a tokenizer; `convert(src, out)` writes a jaxspec checkpoint (see `jaxspec.convert.checkpoint`).
"""

from jaxspec.convert.checkpoint import convert, save_checkpoint
from jaxspec.convert.sources import Source, open_source

__all__ = ["Source", "convert", "open_source", "save_checkpoint"]

"""jaxspec: speculative decoding for LLMs in JAX/XLA."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxspec.xla_flags import apply_gpu_defaults

apply_gpu_defaults()  # before any JAX backend starts: XLA reads XLA_FLAGS once (jaxspec/xla_flags.py)

from jaxspec.errors import JaxspecError  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from jaxspec.engine import Engine, generate

__version__ = "0.1.0"
__all__ = ["Engine", "JaxspecError", "SamplingParams", "__version__", "generate"]


def __getattr__(name: str) -> Any:
    # `jaxspec.Engine` / `jaxspec.generate` load the engine on first use. Importing it here would
    # make a cycle: every `jaxspec.*` import runs this file first (also convert's own imports of
    # jaxspec.errors / jaxspec.config), and the engine imports convert to read checkpoints.
    if name in ("Engine", "generate"):
        from jaxspec import engine

        value = getattr(engine, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

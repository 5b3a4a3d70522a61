"""jaxspec: speculative decoding for LLMs in JAX/XLA."""

from jaxspec.engine import Engine, generate
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "JaxspecError", "SamplingParams", "__version__", "generate"]

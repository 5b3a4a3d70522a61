"""jaxspec: speculative decoding for LLMs in JAX/XLA.

Its subpackages `jaxspec.server`, `jaxspec.convert` and `jaxspec.pallas_kernels` live in the
repository's top-level folders server/, convert/ and pallas_kernels/. An installed wheel holds them
inside jaxspec/ (pyproject.toml's package-dir); in a source checkout (an editable install, or the
repository on PYTHONPATH) `_Folders` maps the three names onto the folders beside this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

FOLDERS = ("server", "convert", "pallas_kernels")


class _Folders(importlib.abc.MetaPathFinder):
    """Finds jaxspec.<folder> (for the FOLDERS) as the package <root>/<folder>; their submodules
    are then found inside it as usual."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in FOLDERS:
            return None
        init = os.path.join(self.root, name, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[os.path.dirname(init)]
        )


_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_here, "server")):  # a source checkout, not a wheel
    sys.meta_path.insert(0, _Folders(os.path.dirname(_here)))

from jaxspec.xla_flags import apply_gpu_defaults  # noqa: E402

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

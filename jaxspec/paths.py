"""Where jaxspec keeps files on this machine: one cache directory, $JAXSPEC_CACHE_DIR (default
~/.cache/jaxspec), holding the converted default model, XLA's compilation cache (xla/) and the
native kernels built for this CPU (native/)."""

from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("JAXSPEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxspec")

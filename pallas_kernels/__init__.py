"""Pallas GPU kernels.

Each kernel family will live in its own file with its jitted wrapper and a pure-jnp reference,
and plug into `jaxspec.attention`. Nothing here yet: the `xla` attention backend is the only one.
"""

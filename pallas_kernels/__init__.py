"""Pallas GPU kernels (Pallas on Triton), each in its own file with its jitted wrapper and a pure-jnp
reference it is tested against:

  tree_attention.py    attention of new query rows (prefill chunks, verification trees, draft-tree
                       steps) over a slot's KV cache with a compact mask; its reference is the `xla`
                       attention backend
  decode_attention.py  split-KV attention of one query row per slot (plain decoding)

`jaxspec.attention` picks them (`--attention-backend pallas`, the default on a GPU).
"""

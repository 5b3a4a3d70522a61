"""`--quantization gguf`: a GGUF file's weight blocks kept as the file stores them.

llama.cpp's Q4_0, Q4_1 and Q8_0 formats store 32 weights per block with a float16 scale (Q4_1 also
a float16 minimum): 18, 20 and 34 bytes per block, 4.5, 5 and 8.5 bits per weight. Under this mode
each Linear whose GGUF tensor has one of these types keeps it as uint8 rows [O, I / 32 * block
bytes] (row o: weight row o, as the file stores it; models/params.py `load_gguf_blocks`), and so
does a block-quantized token embedding [V, H / 32 * block bytes]. Nothing is converted to float32:
a 98 MB Q4_1 SmolLM2 stays about 98 MB instead of 540 MB. Tensors whose rows are a multiple of 8
are reordered at load so that 8 rows' blocks sit side by side (`interleave`, kind + "x8": the same
bytes), the layout the kernel multiplies fastest.

Products run in the native kernel (jaxspec/native/gguf_matmul.cc): activations quantized per
block of 32 to int8 with a float16 scale, as llama.cpp does for these formats, exact integer sums
per block, every weight block read once for up to 8 rows. A token's result does not depend on the
other rows of the call. Embedding rows are read back by `rows` (the rows asked for only). F32 / F16
tensors (norms; some files' output heads) are read as float32 and run as usual.

CPU only: the kernel is XLA:CPU code, and other platforms get a clear error when the model loads.

Mixture-of-experts layers (llama.cpp's `qwen3moe` files) keep their attention, dense MLP and
embedding blocks, but their routers and expert stacks are dequantized to float32 when the model
loads, whatever their type (models/params.py `load_gguf_blocks`, with a warning): the kernel
multiplies one Linear's rows for every token, where a MoE block gathers each token's k experts
(models/moe.py), which would need a gathered block kernel. Float32 experts take 4 bytes a weight
against Q8_0's 1.06 and Q4_0's 0.56 (Qwen3-30B-A3B's 29 billion expert weights: about 116 GB).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import native

BLOCK = 32  # weights per block
KINDS = tuple(native.GGUF_BLOCKS)  # the block types this mode multiplies: Q4_0, Q4_1, Q8_0
FLOAT_KINDS = ("F32", "F16")  # read as float32 beside them


def unsupported_kinds(types: dict[str, str]) -> list[str]:
    """The tensor types of a GGUF file (tensor name -> type) this mode cannot read, sorted."""
    return sorted({t for t in types.values() if t not in KINDS + FLOAT_KINDS})


def block_bytes(kind: str) -> int:
    return native.GGUF_BLOCKS[kind][1]


def interleave(raw: np.ndarray, kind: str) -> np.ndarray:
    """GGUF blocks [O, nb * block bytes] (O a multiple of 8) -> the kernel's interleaved layout of
    `kind + "x8"`, [O / 8, nb * group bytes], the same bytes reordered (gguf_matmul.cc describes it):
    per group of 8 rows and block, the 8 scales (and minimums), then the weights as runs of 32 bytes
    holding 4 weights of each of the 8 rows, so that one dot product instruction serves 8 rows."""
    o, bs = raw.shape[0], block_bytes(kind)
    g = raw.reshape(o // 8, 8, -1, bs).transpose(0, 2, 1, 3)  # [groups, nb, 8 rows, block bytes]
    scales = [g[..., 0:2].reshape(*g.shape[:2], 16)]
    if kind == "Q4_1":
        scales.append(g[..., 2:4].reshape(*g.shape[:2], 16))
    if kind == "Q8_0":  # run k, byte 4 j + i = q[row j][4 k + i]
        q = g[..., 2:].reshape(*g.shape[:3], 8, 4).transpose(0, 1, 3, 2, 4)
    else:  # run t, byte 4 j + i = q[row j][8 t + i] | q[row j][8 t + 4 + i] << 4
        qs = g[..., 4:] if kind == "Q4_1" else g[..., 2:]
        v = np.concatenate([qs & 15, qs >> 4], -1).reshape(*g.shape[:3], 4, 2, 4)  # weight 8 t + 4 h + i
        q = (v[..., 0, :] | (v[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)
    out = np.concatenate([*scales, q.reshape(*g.shape[:2], -1)], -1)
    return np.ascontiguousarray(out.reshape(o // 8, -1))


def rows(w, kind: str, ids):
    """Rows `ids` [...] of a GGUF weight w (plain or interleaved layout of `kind`) as float32 [..., I]."""
    if not kind.endswith("x8"):
        return dequantize(w[ids], kind)
    base, flat = kind[:-2], ids.reshape(-1)
    nb = w.shape[1] // native.GGUF_X8[kind][1]
    grp = w[flat // 8].reshape(flat.shape[0], nb, -1)  # [N, nb, group bytes]
    pick = lambda a: jnp.take_along_axis(a, (flat % 8)[:, None, None, None], axis=2)[:, :, 0]  # [N, nb, 8, k] -> row j
    half = lambda lo: jax.lax.bitcast_convert_type(
        pick(grp[..., lo : lo + 16].reshape(*grp.shape[:2], 8, 2)), jnp.float16
    ).astype(jnp.float32)
    d = half(0)  # [N, nb]
    if base == "Q8_0":
        q = grp[..., 16:].reshape(*grp.shape[:2], 8, 8, 4).transpose(0, 1, 3, 2, 4)  # [N, nb, 8 rows, k, i]
        q = pick(q.reshape(*grp.shape[:2], 8, 32))
        return (d[..., None] * jax.lax.bitcast_convert_type(q, jnp.int8).astype(jnp.float32)).reshape(*ids.shape, -1)
    off = 32 if base == "Q4_1" else 16
    b = grp[..., off:].reshape(*grp.shape[:2], 4, 8, 4).transpose(0, 1, 3, 2, 4)  # [N, nb, 8 rows, t, i]
    b = pick(b.reshape(*grp.shape[:2], 8, 16)).reshape(*grp.shape[:2], 4, 1, 4)
    q = jnp.concatenate([b & 15, b >> 4], -2).reshape(*grp.shape[:2], 32).astype(jnp.float32)
    out = d[..., None] * q + half(16)[..., None] if base == "Q4_1" else d[..., None] * (q - 8)
    return out.reshape(*ids.shape, -1)


def dequantize(w, kind: str):
    """GGUF blocks w [..., nb * block bytes] uint8 of type `kind` -> float32 [..., nb * 32]."""
    lead, bs = w.shape[:-1], block_bytes(kind)
    b = w.reshape(*lead, -1, bs)
    half = lambda lo: jax.lax.bitcast_convert_type(b[..., lo : lo + 2], jnp.float16).astype(jnp.float32)[..., None]
    if kind == "Q8_0":
        q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
        out = half(0) * q
    else:
        qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
        q = jnp.concatenate([qs & 15, qs >> 4], -1).astype(jnp.float32)  # weights 0-15 low nibbles, 16-31 high
        out = half(0) * q + half(2) if kind == "Q4_1" else half(0) * (q - 8)
    return out.reshape(*lead, -1)


def matmul(x, w, kind: str, norm=None):
    """x [..., I] times GGUF blocks w of type `kind` (plain [O, I / 32 * block bytes], or interleaved:
    kind ending in x8) -> [..., O] in x's dtype, by the native kernel (activations quantized per block
    of 32, integer sums exact). norm: (weight [I], eps) of an RMSNorm the kernel applies to each row of
    x first, or None."""
    lead, n = x.shape[:-1], math.prod(x.shape[:-1])
    y = native.gguf_matmul(x.reshape(n, x.shape[-1]).astype(jnp.float32), w, kind, norm)
    return y.reshape(*lead, y.shape[-1]).astype(x.dtype)

"""KV cache: one contiguous region per slot, per-slot lengths.

Layout (kept behind this module so paging can come later):
  k, v:    tuples of num_layers arrays [batch, max_len, num_kv_heads, head_dim]
  lengths: [batch] int32, the number of tokens of each slot that have KV.

One buffer per layer (not one stacked [L, ...] array): XLA:CPU then updates each layer's buffer in
place inside the decode loop; with a stacked array the per-layer scatter copied the whole cache
(measured: 48 ms vs 24 ms per SmolLM2 decode step at max_len 2048).

The cache is a pytree; jitted callers donate it so XLA updates it in place.

Slot views (the server, jaxspec/serving.py): `view(rows, span)` is the same buffers seen as the
slots `rows` [n] only (lengths [n]) and, when `span` is set, attention reads only columns
[0, span). Writes land in place in the full buffers; `unview` puts the lengths back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec import compile_target
from jaxspec.config import ModelConfig
from jaxspec.pallas_kernels import kv_commit


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: tuple  # L x [B, S, Hkv, D]
    v: tuple  # L x [B, S, Hkv, D]
    lengths: jax.Array  # [B] int32 ([n] in a slot view)
    rows: jax.Array | None = None  # [n] int32 slots of a view; None = all slots
    span: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # columns attention reads
    prefix: bool = dataclasses.field(default=False, metadata=dict(static=True))  # rows == arange(n): read by slicing
    # NamedSharding of k, v (tensor parallel) or None
    sharding: NamedSharding | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, max_len: int, dtype, sharding=None) -> KVCache:
        """Zeroed buffers. sharding: where k and v live (tensor parallel: jaxspec/sharding.py
        kv_sharding; lengths are then replicated on its mesh); None = the default device."""
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        z = lambda: tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.num_layers))
        lengths = jnp.zeros((batch,), jnp.int32, device=None if sharding is None else NamedSharding(sharding.mesh, P()))
        return cls(z(), z(), lengths, sharding=sharding)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, start: jax.Array) -> KVCache:
        """Writes k_new/v_new [B, T, Hkv, D] at positions start[b] + t of `layer`.

        Positions past max_len are dropped (padding of a chunked prefill)."""
        b, t = k_new.shape[:2]
        rows = jnp.broadcast_to(self._rows(b), (b, t))  # [B, T]
        cols = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
        if b * t == 1:
            # One column of one slot (a decoding step of one request): XLA would turn the scatter
            # into a dynamic-update-slice and, inside a loop whose body also reads the buffer,
            # copy the whole buffer at every step (two copies of every layer's cache per step on
            # XLA:CPU). The same index written twice with the same values keeps it a scatter,
            # which updates the buffer in place.
            rows, cols = jnp.concatenate([rows, rows], 1), jnp.concatenate([cols, cols], 1)
            k_new, v_new = jnp.concatenate([k_new, k_new], 1), jnp.concatenate([v_new, v_new], 1)
        k = self.k[layer].at[rows, cols].set(k_new.astype(self.k[layer].dtype), mode="drop")
        v = self.v[layer].at[rows, cols].set(v_new.astype(self.v[layer].dtype), mode="drop")
        return self.with_layer(layer, k, v)

    def with_layer(self, layer: int, k: jax.Array, v: jax.Array) -> KVCache:
        """The cache with `layer`'s whole buffers replaced by k, v [B, S, Hkv, D] (written elsewhere,
        e.g. by a kernel that updates them in place)."""
        put = lambda t, x: t[:layer] + (x,) + t[layer + 1 :]
        return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))

    def slots(self, b: int) -> jax.Array:
        """The buffer rows of this cache's b slots: [b] int32."""
        return self._rows(b)[:, 0]

    def commit_path(self, path: jax.Array, backend: str = "xla") -> KVCache:
        """Moves the KV at columns lengths + path[:, i] to lengths + i (an accepted tree path
        becomes contiguous). path: [B, T] node indices relative to lengths; lengths unchanged.
        With the Pallas attention backend (a GPU) and one device, one kernel moves every layer's
        (jaxspec.pallas_kernels.kv_commit) where XLA runs a gather and a scatter per buffer."""
        b, t = path.shape
        rows = self._rows(b)
        src = self.lengths[:, None] + path
        dst = self.lengths[:, None] + jnp.arange(t)[None, :]
        if backend.startswith("pallas") and self.sharding is None:
            interpret = compile_target.platform() != "gpu"
            bufs = kv_commit.commit(self.k + self.v, self.slots(b), src, dst, interpret=interpret)
            n = len(self.k)
            return dataclasses.replace(self, k=tuple(bufs[:n]), v=tuple(bufs[n:]))
        move = lambda x: x.at[rows, dst].set(x[rows, src], mode="drop")
        return dataclasses.replace(self, k=tuple(map(move, self.k)), v=tuple(map(move, self.v)))

    def _rows(self, b: int):
        return (jnp.arange(b) if self.rows is None else self.rows)[:, None]

    def read(self, layer: int, whole: bool = False) -> tuple[jax.Array, jax.Array]:
        """The (k, v) attention sees for `layer`: [B, S, Hkv, D], or [n, span, Hkv, D] in a view.
        whole: the full buffers where the view's slots are their first rows (a full cache, a prefix
        view), for the Pallas kernels: they index a slot's row themselves and read only its first
        `length` columns, and a slice of a kernel's operand would be copied out first (on a GPU,
        every layer's K and V at every step of the server)."""
        k, v = self.k[layer], self.v[layer]
        if whole and (self.rows is None or self.prefix):
            return k, v
        if self.prefix:
            n = self.lengths.shape[0]
            k, v = k[:n], v[:n]
        elif self.rows is not None:
            k, v = k[self.rows], v[self.rows]
        if self.span is not None:
            k, v = k[:, : self.span], v[:, : self.span]
        return k, v

    def view(self, rows: jax.Array, span: int | None = None, prefix: bool = False) -> KVCache:
        """The slots `rows` [n] of this (full) cache; attention reads columns [0, span).
        prefix=True promises rows == arange(n) (reads become slices instead of gathers)."""
        return dataclasses.replace(self, lengths=self.lengths[rows], rows=rows, span=span, prefix=prefix)

    def unview(self, view: KVCache) -> KVCache:
        """This cache with the buffers written through `view` and its slots' lengths."""
        return dataclasses.replace(
            view, lengths=self.lengths.at[view.rows].set(view.lengths), rows=None, span=None, prefix=False
        )

    def reset_slots(self, mask: jax.Array) -> KVCache:
        """Sets lengths of slots where mask [B] is true to 0 (their KV becomes invisible)."""
        return dataclasses.replace(self, lengths=jnp.where(mask, 0, self.lengths))

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self.k + self.v)

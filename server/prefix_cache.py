"""Prefix caching: free request slots as a cache of the prompts whose KV they still hold.

A finished request's slot keeps its KV (target and draft) while free, and the host remembers
which tokens it holds. A new request reuses the longest prefix of its prompt held by a free slot
or by a decoding request's prompt: it takes that free slot as it is, or the prefix's KV columns
are copied into its own slot (one device copy, `copy_prefix`), and only the rest of the prompt is
prefilled. Free slots are the cache: a slot is evicted (least recently used first) when a request
needs it, so the cache never fails or delays a request, and it holds at most one prefix per slot.
Why copies into contiguous slots rather than paged KV: both attention backends read one
contiguous region per slot, and a copy of a prefix costs far less than prefilling it
(benchmarks/RESULTS.md).

The scheduler calls every method with its lock held.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from jaxspec.requests import bucket, common_prefix


class PrefixCache:
    def __init__(self, enabled: bool, min_reuse: int):
        self.enabled = enabled
        # the shortest prefix worth a copy (or a wait for a prompt being prefilled)
        self.min_reuse = min_reuse
        self.held: dict[int, np.ndarray] = {}  # free slot -> the tokens whose KV it holds
        self.used: dict[int, float] = {}  # slot -> when its prefix was last used

    def lookup(self, ids: np.ndarray, decoding: Iterable[tuple[int, np.ndarray]]) -> tuple[int | None, int]:
        """The slot holding the longest prefix of the prompt `ids` [L] and its length (at most
        L - 1: the last prompt token is always prefilled, for its logits), or (None, 0). Free
        slots hold what `held` says; `decoding`: (slot, prompt) of the decoding requests."""
        if not self.enabled:
            return None, 0
        best, src = 0, None
        for s, toks in [*self.held.items(), *decoding]:
            m = common_prefix(ids, toks)
            if m > best:
                best, src = m, s
        return src, min(best, len(ids) - 1)

    def touch(self, slot: int) -> None:
        self.used[slot] = time.perf_counter()

    def pick_slot(self, free: list[int], src: int | None, busy: Iterable[int]) -> int:
        """The free slot a new request takes: the one keeping dispatches smallest (they cover
        slots [0, n_act), n_act a power of two above the highest busy slot), then the slot holding
        its prefix (no copy), then one holding nothing, then the least recently used."""
        top = max(busy, default=-1)
        return min(
            free,
            key=lambda s: (bucket(max(top, s) + 1), s != src, s in self.held, self.used.get(s, 0.0), s),
        )

    def take(self, slot: int, src: int | None, free: list[int]) -> tuple[int, int] | None:
        """A request takes `slot` (its prefix read from `src`): the slot's own cached prefix, unless
        reused in place, moves to another free slot (`evict_for`). Returns (that slot, the
        prefix's length): the caller copies those KV columns there. None: nothing to move."""
        old = self.held.pop(slot, None)
        if old is None or src == slot:  # (reused in place, its tail is superseded)
            return None
        to = self.evict_for(old, self.used.get(slot, 0.0), free)
        return None if to is None else (to, len(old))

    def evict_for(self, toks: np.ndarray, used: float, free: list[int]) -> int | None:
        """A free slot to move the cached prefix `toks` (last used at `used`) to: one holding
        nothing, else the least recently used if it was used before `toks`; the highest first (the
        lowest are taken first). Marks it as holding `toks`. None: no such slot, or too short a
        prefix to be worth a copy (then it is evicted)."""
        if len(toks) < self.min_reuse or not free:
            return None
        to = min(free, key=lambda s: (s in self.held, self.used.get(s, 0.0), -s))
        if to in self.held and self.used.get(to, 0.0) >= used:
            return None
        self.held[to], self.used[to] = toks, used
        return to

    def keep(self, slot: int, toks: np.ndarray) -> None:
        """A finished request's free slot holds the KV of `toks`."""
        if self.enabled and len(toks):
            self.held[slot] = toks
            self.touch(slot)

    def forget(self, rows: Iterable[int], col: int) -> None:
        """The slots `rows` are overwritten from column `col` on (a program run on free slots):
        their cached prefixes are cut before it (one more column: the draft's entries are shifted)."""
        for s in rows:
            if s in self.held:
                self.held[s] = self.held[s][: max(col - 1, 0)]
                if not len(self.held[s]):
                    del self.held[s]

    def held_length(self, slot: int) -> int:
        """How many leading columns of `slot` hold a cached prefix (0: none)."""
        return len(self.held.get(slot, ()))

    def flush(self) -> int:
        """Forgets every cached prefix. Returns how many slots held one."""
        n = len(self.held)
        self.held.clear()
        return n

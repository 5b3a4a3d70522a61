"""The proposer protocol: what the compiled round needs from a draft method.

A proposer is a frozen (hashable, jit-static) dataclass; its arrays live in a separate `dparams`
pytree. Each method runs inside the jitted round with the merged target model `tgt` at hand
(EAGLE shares its embedding and LM head).

Draft KV layout: committed entries [0, lengths), then a local region for the draft tree. With
`root_in_region` (STANDALONE) region column 0 holds x_L and the tree's beams follow it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxspec.attention import with_mode
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.errors import JaxspecError


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    cache: Any  # KVCache for model drafts; the proposer's own history for NGRAM
    root_probs: jax.Array  # [B, Vd] draft distribution of x_L's successor
    root_hidden: jax.Array  # [B, Hd] hidden fed to x_L's children ([B, 1] zeros when unused)
    # multi-layer MTP, inside a round only: the chain drafted so far [B, d] (None between rounds)
    chain: jax.Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Proposer:
    graphdef: Any  # draft module graphdef
    cfg: ModelConfig  # of the draft decoder layer(s)
    root_in_region: bool  # STANDALONE: x_L's KV sits at region column 0
    shift: int  # EAGLE: draft entry p holds token p + 1 (1); STANDALONE: token p (0)
    draft_vocab: int  # size of the draft distribution (FR-Spec map, EAGLE-3 draft vocab, or full)
    capture_layers: tuple = ()  # target layers whose inputs the draft consumes (EAGLE-3)
    uses_hidden: bool = False  # the draft consumes target / fed-back hidden states
    builds_tree: bool = False  # the proposer builds the whole tree itself (propose_tree), e.g. NGRAM
    attention_backend: str = "xla"  # the draft model's attention (jaxspec.attention); the engine sets it
    attention_mode: str = "prefill"  # the attention mode of `extend` (--speculative-attention-mode)

    @property
    def extend_backend(self) -> str:
        """The backend string `extend` runs its draft forward with (attention.with_mode)."""
        return with_mode(self.attention_backend, self.attention_mode)

    def __hash__(self):
        return id(self)

    # --- what the round calls -------------------------------------------------------------------

    def features(self, h, captured):
        """Target features the draft consumes: h [B, T, H] final hidden, captured [3, B, T, H]."""
        return None

    def make_cache(self, batch: int, max_len: int, dtype):
        """The draft's per-slot state that prefill fills (a KV cache for model drafts)."""
        return KVCache.create(self.cfg, batch, max_len, dtype)

    def propose_tree(self, dparams, state: DraftState, last, spec):
        """builds_tree proposers: the round's Tree (jaxspec.speculative.tree) below x_L = last [B]."""
        raise NotImplementedError

    def prefill_chunk(self, dparams, tgt, cache: KVCache, tokens, feats, start, commit_lens) -> KVCache:
        """Draft prefill of one chunk: entries start + t (tokens [B, C], feats [B, C, F] | None);
        afterwards lengths = min(commit_lens, start + C)."""
        raise NotImplementedError

    def extend(self, dparams, tgt, state: DraftState, tokens, feats, n_block, active) -> DraftState:
        """Writes a block of entries at lengths (tokens [B, T], feats [B, T, F] | None), of which
        n_block [B] are real; commits them (all but the last when root_in_region) for active
        slots; the root distribution/hidden come from entry n_block - 1."""
        raise NotImplementedError

    def step(self, dparams, tgt, state: DraftState, tokens, hidden, depth: int, mask, offset):
        """Feeds the beams (tokens [B, k] at tree depth `depth`) -> (probs [B, k, Vd], hidden | None, state)."""
        raise NotImplementedError

    def to_target(self, dparams, ids):
        tm = dparams.get("token_map")
        return ids if tm is None else tm[ids]


def load_token_map(path: str, vocab_size: int) -> np.ndarray:
    """FR-Spec token map: a list of target token ids as .pt (torch list/tensor), .npy, or text."""
    try:
        if path.endswith(".pt"):
            try:
                import torch
            except ImportError:
                raise JaxspecError(
                    f"{path} is a torch file; install torch or pass the token map as .npy or text"
                ) from None
            ids = np.asarray(torch.load(path, map_location="cpu", weights_only=True), dtype=np.int64)
        elif path.endswith(".npy"):
            ids = np.load(path)
        else:
            with open(path) as f:
                ids = np.asarray([int(x) for x in f.read().replace(",", " ").split()], np.int64)
    except FileNotFoundError:
        raise JaxspecError(f"speculative_token_map not found: {path}") from None
    except (ValueError, OSError) as e:
        raise JaxspecError(f"cannot read speculative_token_map {path}: {e}") from None
    ids = ids.reshape(-1)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise JaxspecError(f"speculative_token_map {path} must hold token ids in [0, {vocab_size})")
    return np.unique(ids).astype(np.int32)

"""`Models`: the target and its draft as every compiled program takes them, one argument.

A pytree: the weights (`params`, the draft's `dparams`) are its leaves, traced like any array;
the module structure (`graphdef`), the proposer and the attention backend are its static part,
so a program compiles once per model and backend, as static arguments would. Built by `Engine`
(jaxspec/engine.py `Engine.models`) from what jaxspec/prepare.py made.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

if TYPE_CHECKING:  # (the proposers' package imports the decoding modules that import this one)
    from jaxspec.speculative.proposers.base import Proposer


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["params", "dparams"], meta_fields=["graphdef", "prop", "backend"]
)
@dataclasses.dataclass(frozen=True, eq=False)
class Models:
    graphdef: Any  # the target's nnx GraphDef
    params: Any  # the target's parameters (nnx.State)
    prop: Proposer | None = None  # the draft's proposer (None: plain decoding)
    dparams: Any = None  # the draft's parameters ({"draft": nnx.State, ...}, or the n-gram corpus)
    backend: str = "xla"  # the target's attention backend (jaxspec.attention); the draft's is prop's

    def target(self) -> Any:
        """The target as an nnx module (inside a traced program: its weights are the tracers)."""
        return nnx.merge(self.graphdef, self.params)

    @property
    def draft(self) -> Proposer:
        assert self.prop is not None, "a speculative program needs a proposer"
        return self.prop

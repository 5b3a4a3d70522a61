"""How a target runs when the user leaves it to jaxspec (jaxspec/default_mode.py): a GGUF file on
a CPU at its own quantization (gguf) and without the shipped draft; float32 everywhere else."""

from __future__ import annotations

import types

import jax
import pytest

from jaxspec import compile_target, default_mode, native
from jaxspec.args import EngineArgs

needs_kernel = pytest.mark.skipif(
    jax.default_backend() != "cpu" or native.gguf_unavailable() is not None, reason="the GGUF kernel runs on XLA:CPU"
)


@needs_kernel
def test_a_gguf_keeps_its_blocks_unless_something_asks_otherwise(monkeypatch):
    assert default_mode.may_keep_gguf_blocks(EngineArgs())  # the defaults: --dtype auto, no --quantization
    assert default_mode.may_keep_gguf_blocks(EngineArgs(dtype="auto", speculative_algorithm="EAGLE3"))
    for asked in (
        dict(dtype="float32"),  # float32 by name: the reading checked against HF transformers
        dict(dtype="bfloat16"),
        dict(quantization="w8a8_int8"),
        dict(tp_size=2),  # the kernel runs on one device
        dict(speculative_online_train=True),  # the head learns from the float target's features
    ):
        assert not default_mode.may_keep_gguf_blocks(EngineArgs(**asked)), asked
    monkeypatch.setattr(compile_target, "platform", lambda: "gpu")  # a GPU keeps today's default
    assert not default_mode.may_keep_gguf_blocks(EngineArgs())


def test_only_a_gguf_the_kernel_reads_runs_as_gguf():
    src = lambda kind, *kinds: types.SimpleNamespace(kind=kind, types={f"t{i}": k for i, k in enumerate(kinds)})
    assert default_mode.gguf_default(src("gguf", "Q4_1", "Q8_0", "F32")) == "gguf"
    assert default_mode.gguf_default(src("gguf", "Q4_1", "Q4_K")) is None  # K-quants: the float32 reading
    assert default_mode.gguf_default(src("hf")) is None  # a float checkpoint keeps float32


def test_the_shipped_draft_follows_the_mode():
    assert not default_mode.shipped_draft_by_default("gguf")
    for mode in (None, "int8", "fp8", "w8a8_int8"):
        assert default_mode.shipped_draft_by_default(mode)


@needs_kernel
def test_the_default_model_loads_its_gguf_as_gguf():
    """No flags: the default model's GGUF file itself, in its blocks; --dtype float32: its float32
    conversion, as before."""
    from jaxspec.default_model import default_gguf_path, default_model_path
    from jaxspec.loader import load_target

    auto = load_target(EngineArgs(), progress=False, with_tokenizer=False)
    assert (auto.quantization, auto.source_kind, auto.path) == ("gguf", "gguf", default_gguf_path())
    f32 = load_target(EngineArgs(dtype="float32"), progress=False, with_tokenizer=False)
    assert (f32.quantization, f32.path) == (None, default_model_path(progress=False))


def test_start_up_messages_name_the_mode():
    import jax.numpy as jnp

    eng = lambda q, asked=None, dtype=jnp.float32: types.SimpleNamespace(
        quantization=q, dtype=dtype, args=types.SimpleNamespace(quantization=asked)
    )
    assert default_mode.target_mode(eng("gguf")).startswith("gguf (a GGUF file's own blocks: on a CPU the default")
    assert default_mode.target_mode(eng("gguf", asked="gguf")) == "gguf"
    assert default_mode.target_mode(eng(None)) == "float32"
    assert default_mode.target_mode(eng(None, dtype=jnp.bfloat16)) == "bfloat16"
    assert default_mode.target_mode(eng("w8a8_int8", asked="w8a8_int8")) == "w8a8_int8"

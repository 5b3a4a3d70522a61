"""Pallas attention kernels against their jnp references, and the engine on the pallas backend.

Off a GPU the kernels run in Pallas interpret mode (the same kernel body, executed by the CPU); on a
GPU the same tests run the compiled Triton kernels. Cases: ragged kv_len per slot (including 0 and a
full cache), N in {1, 4, 8, 16, 32, 64} tree tokens with ancestor masks of real trees (random parent
pointers through `build_tree`), GQA ratios 1/3/4/8, float32 and bfloat16, causal prefill chunks with
row tiling, draft-beam masks with an offset, sliding windows, and explicit split counts. Decode
mode (the prefix through the decode kernel, the local region apart, merged by log-sum-exps) against
the one-pass reference, and the engine in that mode token-identical to plain decoding.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from jaxspec.pallas_kernels.tree_attention import Blocks, tree_attention, tree_attention_reference
from jaxspec.speculative.tree import build_tree

INTERPRET = jax.default_backend() != "gpu"
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _full_precision_references():
    """The references are XLA einsums, and on a GPU XLA's default float32 matmul runs in TF32 (about
    1e-3 relative error), while the kernels compute float32 in IEEE precision; compare against
    references computed in full float32."""
    with jax.default_matmul_precision("highest"):
        yield


def _qkv(seed, b, t, h, hkv, d, s, dtype):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, t, h, d), (b, s, hkv, d), (b, s, hkv, d))
    )
    return rng, q, k, v


def _tree_mask(rng, b, n):
    """Ancestor-or-self masks [B, N, N] of random trees (parent[i] < i), as verification builds them."""
    parent = np.zeros((b, n), np.int32)
    for i in range(1, n):
        parent[:, i] = rng.integers(0, i, size=b)
    return build_tree(jnp.zeros((b, n), jnp.int32), jnp.asarray(parent), max_depth=n).anc


def _close(out, ref, dtype):
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype])


# (N tree tokens, GQA ratio, dtype): every N, every ratio, both dtypes, without the full product.
TREE_CASES = [
    (1, 1, jnp.float32),
    (4, 3, jnp.bfloat16),
    (8, 4, jnp.float32),
    (16, 8, jnp.bfloat16),
    (32, 1, jnp.bfloat16),
    (64, 3, jnp.float32),
    (16, 4, jnp.bfloat16),
    (8, 8, jnp.float32),
]


@pytest.mark.parametrize("n,group,dtype", TREE_CASES, ids=[f"N{n}-G{g}-{jnp.dtype(d).name}" for n, g, d in TREE_CASES])
def test_pallas_tree_attention_matches_reference(n, group, dtype):
    b, hkv, d, s = 3, 2, 64 if n % 2 else 128, 256
    rng, q, k, v = _qkv(n, b, n, hkv * group, hkv, d, s, dtype)
    kv_len = jnp.asarray([0, 77, s - n], jnp.int32)  # empty prefix, ragged, the tree ends at the last column
    mask = _tree_mask(rng, b, n)
    out = tree_attention(q, k, v, kv_len, mask, interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    _close(out, tree_attention_reference(q, k, v, kv_len, mask), dtype)


@pytest.mark.parametrize("group,dtype", [(1, jnp.bfloat16), (3, jnp.float32), (4, jnp.bfloat16), (8, jnp.float32)])
def test_pallas_decode_attention_matches_reference(group, dtype):
    b, hkv, d, s = 4, 2, 128, 512
    _, q, k, v = _qkv(group, b, 1, hkv * group, hkv, d, s, dtype)
    kv_len = jnp.asarray([1, 5, 300, s], jnp.int32)
    out = decode_attention(q[:, 0], k, v, kv_len, interpret=INTERPRET)
    _close(out, decode_attention_reference(q[:, 0], k, v, kv_len), dtype)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_pallas_decode_splits_and_sliding_window(splits):
    """Any split count merges to the same result; a sliding window limits what the query sees."""
    b, hkv, group, d, s = 2, 1, 4, 64, 1024
    _, q, k, v = _qkv(10 + splits, b, 1, hkv * group, hkv, d, s, jnp.float32)
    kv_len = jnp.asarray([1000, 37], jnp.int32)
    _close(
        decode_attention(q[:, 0], k, v, kv_len, blocks=Blocks(splits=splits), interpret=INTERPRET),
        decode_attention_reference(q[:, 0], k, v, kv_len),
        jnp.float32,
    )
    _close(
        decode_attention(q[:, 0], k, v, kv_len, sliding_window=100, blocks=Blocks(splits=splits), interpret=INTERPRET),
        decode_attention_reference(q[:, 0], k, v, kv_len, sliding_window=100),
        jnp.float32,
    )


def test_pallas_causal_prefill_chunk_with_row_tiles():
    """A causal chunk of T = 40 tokens x G = 3 rows spans two 64-row tiles; with an offset and a window."""
    b, t, hkv, group, d, s = 2, 40, 2, 3, 64, 128
    _, q, k, v = _qkv(7, b, t, hkv * group, hkv, d, s, jnp.float32)
    kv_len = jnp.asarray([0, 50], jnp.int32)
    for kw in (dict(), dict(offset=3), dict(sliding_window=16)):
        _close(
            tree_attention(q, k, v, kv_len, None, interpret=INTERPRET, **kw),
            tree_attention_reference(q, k, v, kv_len, None, **kw),
            jnp.float32,
        )


def test_pallas_draft_beam_mask():
    """An EAGLE draft step: topk = 4 beams over W = 13 draft-tree tokens, each beam seeing its path."""
    b, topk, w, hkv, group, d, s = 2, 4, 13, 2, 4, 64, 192
    rng, q, k, v = _qkv(3, b, topk, hkv * group, hkv, d, s, jnp.bfloat16)
    mask = jnp.asarray(rng.random((b, topk, w)) < 0.4)
    kv_len = jnp.asarray([60, 179], jnp.int32)  # the second slot's region runs past the cache end
    _close(
        tree_attention(q, k, v, kv_len, mask, offset=9, interpret=INTERPRET),
        tree_attention_reference(q, k, v, kv_len, mask, offset=9),
        jnp.bfloat16,
    )


def test_kernels_return_the_log_sum_exp():
    """return_lse: float32 outputs and each row's log-sum-exp of scaled scores (-inf, zeros for a
    row that sees nothing), from the tree kernel, the decode kernel and the decode reference."""
    b, n, hkv, group, d, s = 3, 8, 2, 3, 64, 128
    rng, q, k, v = _qkv(21, b, n, hkv * group, hkv, d, s, jnp.float32)
    kv_len = jnp.asarray([0, 40, s - n], jnp.int32)
    mask = _tree_mask(rng, b, n)
    out, lse = tree_attention(q, k, v, kv_len, mask, interpret=INTERPRET, return_lse=True)
    assert out.dtype == lse.dtype == jnp.float32 and lse.shape == (b, n, hkv * group)
    _close(out, tree_attention_reference(q, k, v, kv_len, mask), jnp.float32)
    # the reference's visibility, rebuilt densely: prefix columns, then the mask over the region
    col = np.arange(s)[None, None, :]
    rel = col - np.asarray(kv_len)[:, None, None]
    vis = (rel < 0) | ((rel < n) & np.take_along_axis(np.asarray(mask), np.clip(rel, 0, n - 1).repeat(n, 1), 2))
    scores = jnp.einsum("bthd,bshd->bths", q, jnp.repeat(k, group, axis=2)) * d**-0.5
    want = jax.nn.logsumexp(jnp.where(vis[:, :, None], scores, -jnp.inf), axis=-1)
    _close(lse, want, jnp.float32)
    for fn in (functools.partial(decode_attention, interpret=INTERPRET), decode_attention_reference):
        o, row_lse = fn(q[:, 0], k, v, kv_len, return_lse=True)
        assert o.dtype == jnp.float32
        dense = jnp.where(col[:, 0, None, :] < np.asarray(kv_len)[:, None, None], scores[:, 0], -jnp.inf)
        _close(row_lse[1:], jax.nn.logsumexp(dense, axis=-1)[1:], jnp.float32)
        assert np.all(np.isneginf(np.asarray(row_lse[0]))) and not np.any(np.asarray(o[0]))  # kv_len 0


# make test runs the first two; make test-all all four
SPLIT_CASES = [
    pytest.param(n, g, d, id=f"N{n}-G{g}-{jnp.dtype(d).name}", marks=[pytest.mark.slow] if slow else [])
    for n, g, d, slow in [
        (8, 3, jnp.float32, False),
        (16, 4, jnp.bfloat16, False),
        (1, 1, jnp.float32, True),
        (64, 8, jnp.bfloat16, True),
    ]
]


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("n,group,dtype", SPLIT_CASES)
def test_decode_mode_matches_the_one_pass_reference(backend, n, group, dtype, monkeypatch):
    """--speculative-attention-mode decode: verification trees (empty prefix, ragged, ending at the
    cache's last column) and causal extend blocks at an offset give the one-pass result (the split
    path itself: on a CPU the xla backend's float32 rows otherwise go to the native kernel)."""
    from jaxspec import attention as attn
    from jaxspec.attention import attention, with_mode

    monkeypatch.setattr(attn, "NATIVE_ROWS", 0)

    b, hkv, d, s = 3, 2, 64, 256
    rng, q, k, v = _qkv(30 + n, b, n, hkv * group, hkv, d, s, dtype)
    kv_len = jnp.asarray([0, 77, s - n - 3], jnp.int32)
    mask = _tree_mask(rng, b, n)
    mode = with_mode(backend, "decode")
    assert mode == f"{backend}:decode" and with_mode(mode, "prefill") == backend
    _close(attention(q, k, v, kv_len, mask, backend=mode), tree_attention_reference(q, k, v, kv_len, mask), dtype)
    _close(
        attention(q, k, v, kv_len, None, offset=3, backend=mode),
        tree_attention_reference(q, k, v, kv_len, None, offset=3),
        dtype,
    )


def test_decode_mode_leaves_what_it_does_not_split_to_the_one_path(caplog, monkeypatch):
    """One causal row is plain decode already; a sliding window or a traced offset runs the one
    pass (logged once); an unknown mode is an error. (The split path itself: on a CPU the xla
    backend's float32 rows otherwise go to the native kernel.)"""
    from jaxspec import attention as attn
    from jaxspec.attention import attention, with_mode

    monkeypatch.setattr(attn, "NATIVE_ROWS", 0)

    b, t, hkv, group, d, s = 2, 4, 1, 2, 16, 64
    _, q, k, v = _qkv(5, b, t, hkv * group, hkv, d, s, jnp.float32)
    kv_len = jnp.asarray([3, 40], jnp.int32)
    ref = lambda **kw: tree_attention_reference(q, k, v, kv_len, None, **kw)
    with caplog.at_level(logging.INFO, logger="jaxspec.attention"):
        _close(attention(q, k, v, kv_len, None, 8, backend="xla:decode"), ref(sliding_window=8), jnp.float32)
        traced = jax.jit(lambda off: attention(q, k, v, kv_len, None, offset=off, backend="xla:decode"))(2)
        _close(traced, ref(offset=2), jnp.float32)
    assert "sliding window" in caplog.text and "traced offset" in caplog.text
    one = attention(q[:, :1], k, v, kv_len, backend="xla:decode")
    _close(one, tree_attention_reference(q[:, :1], k, v, kv_len), jnp.float32)
    with pytest.raises(ValueError, match="unknown attention mode"):
        attention(q, k, v, kv_len, backend="xla:sideways")
    with pytest.raises(ValueError, match="unknown attention mode"):
        with_mode("xla", "sideways")


# ---- the engine on the pallas backend -----------------------------------------------------------

V = 16
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4]]
GREEDY = dict(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from helpers import make_hf_model, save_eagle_head

    d = tmp_path_factory.mktemp("pallas")
    tgt = make_hf_model(
        "llama", 3, vocab_size=V, num_hidden_layers=3, initializer_range=0.3, max_position_embeddings=64
    )
    tgt.save_pretrained(d / "target")
    make_hf_model(
        "llama", 5, vocab_size=V, num_hidden_layers=1, initializer_range=0.3, max_position_embeddings=64
    ).save_pretrained(d / "small")
    eagle3 = save_eagle_head(
        d / "eagle3", "EAGLE3", tgt.config.to_dict(), seed=2, draft_vocab=12, scale=10.0, aux_layer_ids=[0, 1, 2]
    )
    return {"target": str(d / "target"), "small": str(d / "small"), "eagle3": eagle3}


@pytest.mark.parametrize(
    "algo,draft,knobs",
    [
        (None, None, None),
        ("EAGLE3", "eagle3", (3, 4, 8)),
        pytest.param("STANDALONE", "small", (3, 2, 6), marks=pytest.mark.slow),
    ],
)
def test_engine_pallas_backend_token_identical(models, algo, draft, knobs, caplog):
    from jaxspec.engine import Engine

    spec = {}
    if algo:
        spec = dict(
            speculative_algorithm=algo,
            speculative_draft_model_path=models[draft],
            speculative_num_steps=knobs[0],
            speculative_eagle_topk=knobs[1],
            speculative_num_draft_tokens=knobs[2],
        )
    outs = {}
    for backend in ("xla", "pallas"):
        eng = Engine(
            models["target"],
            skip_tokenizer_init=True,
            show_progress=False,
            chunked_prefill_size=8,
            attention_backend=backend,
            **spec,
        )
        assert eng.backend == backend and (eng.proposer is None or eng.proposer.attention_backend == backend)
        with caplog.at_level(logging.WARNING):
            outs[backend] = [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert "using xla" not in caplog.text  # the kernels ran; no shape fell back
    assert outs["pallas"] == outs["xla"]


# off a GPU the pallas kernels run interpreted: slow (make test-all); tp = 2 on pallas runs in test_tp.py
@pytest.mark.parametrize(
    "algo,draft,knobs,backends",
    [
        ("EAGLE3", "eagle3", (3, 4, 8), ("xla",)),
        pytest.param("EAGLE3", "eagle3", (3, 4, 8), ("pallas",), marks=pytest.mark.slow),
        pytest.param("STANDALONE", "small", (3, 2, 6), ("xla", "pallas"), marks=pytest.mark.slow),
    ],
)
def test_engine_decode_attention_mode_token_identical(models, algo, draft, knobs, backends):
    """--speculative-attention-mode decode on both backends: greedy output equal to plain decoding."""
    from jaxspec.engine import Engine

    kw = dict(skip_tokenizer_init=True, show_progress=False, chunked_prefill_size=8)
    plain = [
        r["output_ids"] for r in Engine(models["target"], **kw).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    ]
    steps, topk, n = knobs
    spec = dict(
        speculative_algorithm=algo,
        speculative_draft_model_path=models[draft],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=n,
        speculative_attention_mode="decode",
    )
    for backend in backends:
        eng = Engine(models["target"], attention_backend=backend, **kw, **spec)
        assert eng.spec.attention_mode == "decode" and eng.proposer.extend_backend == f"{backend}:decode"
        out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in out] == plain
        assert sum(r["meta_info"]["spec_verify_ct"] for r in out) < sum(len(p) for p in plain)  # drafts accepted


def test_backend_flag_errors_and_default():
    from jaxspec.attention import resolve_backend
    from jaxspec.engine import Engine
    from jaxspec.errors import JaxspecError

    assert resolve_backend(None) == ("pallas" if jax.default_backend() == "gpu" else "xla")
    with pytest.raises(JaxspecError, match="available: xla, pallas"):
        Engine("unused", attention_backend="flash")


def test_pallas_self_check_passes():
    """The check `default_backend()` runs before choosing pallas on a GPU (here: interpreted)."""
    from jaxspec.attention import pallas_self_check

    assert pallas_self_check() is None

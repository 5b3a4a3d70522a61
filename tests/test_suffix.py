"""Text-match candidates merged into a draft model's tree (--speculative-suffix-draft-tokens): the
merge against hand-built trees, flag validation, and end-to-end losslessness (tiny random target
with EAGLE-3 and STANDALONE drafts) where repeated text makes the candidates accepted."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.speculative.proposers.suffix import merge_trees
from jaxspec.speculative.tree import build_tree

from helpers import GREEDY, PROMPTS, engine, models, plain, resolve_spec  # noqa: F401 - fixtures

SUFFIX = dict(speculative_suffix_draft_tokens=6, speculative_suffix_min_match=1)


def tree(tokens, parent, depth=4):
    return build_tree(jnp.asarray([tokens], jnp.int32), jnp.asarray([parent], jnp.int32), depth)


def as_lists(t):
    return [np.asarray(x)[0].tolist() for x in (t.tokens, t.parent, t.depth)]


def test_merge_keeps_siblings_distinct_and_moves_children_below_the_draft():
    # draft: root 9 -> 1 -> 2, root -> 3; match: root 9 -> 1 -> 2 -> 7, root -> 4, and a padding node
    draft = tree([9, 1, 3, 2], [0, 0, 0, 1])
    match = tree([9, 1, 2, 7, 4, 0], [0, 0, 1, 2, 0, 5])
    tokens, parent, depth = as_lists(merge_trees(draft, match, 4))
    assert tokens == [9, 1, 3, 2, 1, 2, 7, 4, 0]
    # match nodes 1 and 2 repeat draft nodes 1 and 3 (paths 9-1, 9-1-2): padding (their own parents);
    # 7 hangs below the draft's node 3, 4 below the root, the match's padding stays padding
    assert parent == [0, 0, 0, 1, 4, 5, 3, 0, 8]
    assert depth[:4] == [0, 1, 1, 2] and depth[6] == 3 and depth[7] == 1
    for p in range(len(tokens)):  # siblings distinct, below every real node
        kids = [tokens[c] for c in range(1, len(tokens)) if parent[c] == p and c != p]
        assert len(kids) == len(set(kids)), (p, kids)


def test_merge_carries_the_spine():
    import dataclasses

    draft = tree([9, 1, 3], [0, 0, 0])
    draft = dataclasses.replace(
        draft,
        spine=jnp.asarray([[False, True, False]]),
        qx=jnp.asarray([[1.0, 0.5, 1.0]]),
        qd=jnp.ones((1, 4, 5)),
        q_index=jnp.arange(12),
    )
    merged = merge_trees(draft, tree([9, 3, 5], [0, 0, 1]), 4)
    assert np.asarray(merged.spine)[0].tolist() == [False, True, False, False, False]
    assert np.asarray(merged.qx)[0].tolist() == [1.0, 0.5, 1.0, 1.0, 1.0]
    assert as_lists(merged)[1] == [0, 0, 0, 3, 2]  # match node 3 is the draft's node 2; 5 below it


def test_validation_and_resolution():
    s = resolve_spec("EAGLE3", draft_model_path="x", suffix_draft_tokens=10, suffix_min_match=3)
    assert s.suffix is not None and s.suffix.match_type == "PROB" and s.suffix.min_match_window_size == 3
    assert s.tree_nodes == s.num_draft_tokens + 10 and s.depth == max(s.num_steps, 10)
    assert s.scratch_tokens == s.tree_nodes + s.num_steps * s.eagle_topk + 2
    assert resolve_spec("EAGLE3", draft_model_path="x").suffix is None
    with pytest.raises(JaxspecError, match="NGRAM proposes"):
        resolve_spec("NGRAM", suffix_draft_tokens=4)
    with pytest.raises(JaxspecError, match="longest match tried"):
        resolve_spec("EAGLE3", draft_model_path="x", suffix_draft_tokens=4, suffix_min_match=20)
    with pytest.raises(JaxspecError, match="suffix_draft_tokens >= 0"):
        resolve_spec("EAGLE3", draft_model_path="x", suffix_draft_tokens=-1)


@pytest.mark.parametrize(
    ("algo", "draft", "knobs"),
    [
        ("EAGLE3", "eagle3", (3, 4, 8)),
        pytest.param("EAGLE3", "eagle3", (2, 1, 3), marks=pytest.mark.slow),
        pytest.param("STANDALONE", "small", (3, 2, 5), marks=pytest.mark.slow),
    ],
)
def test_greedy_identical_to_plain(models, plain, algo, draft, knobs):  # noqa: F811
    eng = engine(models, algo, draft, knobs, **SUFFIX)
    long = dict(GREEDY, max_new_tokens=48)
    ref = engine(models).generate(input_ids=PROMPTS, sampling_params=long)
    alone = engine(models, algo, draft, knobs).generate(input_ids=PROMPTS, sampling_params=long)
    out = eng.generate(input_ids=PROMPTS, sampling_params=long)
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in ref]
    rounds = lambda rs: sum(r["meta_info"]["spec_verify_ct"] for r in rs)
    # a tiny random model repeats itself: the text matches are accepted, fewer rounds than the draft alone
    assert rounds(out) < rounds(alone)
    again = eng.generate(input_ids=PROMPTS, sampling_params=long)  # matched against the first call's text too
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in ref]
    assert rounds(again) <= rounds(out)


def serve(eng, prompts, params, cache):
    """Outputs of `prompts` through the server's continuous batching (2 slots), the first len(PROMPTS)
    finished before the rest arrive."""
    res: dict = {}
    serve_scheduler(eng, prompts, params, cache, res)
    return [res[i] for i in range(len(prompts))]


def serve_scheduler(eng, prompts, params, cache=False, res=None):
    """The Scheduler that served `prompts` (as `serve`), results into `res`."""
    from jaxspec.sampling import SamplingParams
    from jaxspec.server.scheduler import Request, Scheduler

    sched = Scheduler(eng, max_running_requests=2, prefix_cache=cache)
    res = {} if res is None else res
    for i, p in enumerate(prompts):
        emit = lambda e, i=i: res.__setitem__(i, e["result"]) if e["type"] == "done" else None
        sched.submit(Request(ids=p, params=SamplingParams.from_dict(params), speculative=True, emit=emit))
        if i == len(PROMPTS) - 1:
            sched.run_until_idle()
    sched.run_until_idle()
    return sched


@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True])
def test_served_greedy_identical_to_plain(models, cache):  # noqa: F811
    """Through the server's continuous batching (prefix cache off and on: a slot's text is copied
    with its KV): the same tokens as plain decoding, and fewer rounds than the draft alone."""
    long = dict(GREEDY, max_new_tokens=32)
    ref = [r["output_ids"] for r in engine(models).generate(input_ids=PROMPTS, sampling_params=long)]
    prompts = PROMPTS + [p + ref[i][:8] for i, p in enumerate(PROMPTS)]  # second turns: a cached prefix each
    out = serve(engine(models, "EAGLE3", "eagle3", (3, 2, 6), **SUFFIX), prompts, long, cache)
    ids = [r["output_ids"] for r in out]
    assert ids[: len(PROMPTS)] == ref
    for i in range(len(PROMPTS)):  # a second turn continues the first
        assert ids[len(PROMPTS) + i][: len(ref[i]) - 8] == ref[i][8:]
    if not cache:
        alone = serve(engine(models, "EAGLE3", "eagle3", (3, 2, 6)), prompts, long, cache)
        rounds = lambda rs: sum(r["meta_info"]["spec_verify_ct"] for r in rs)
        assert [r["output_ids"] for r in alone] == ids and rounds(out) < rounds(alone)


def test_flush_cache_forgets_the_shared_text(models):  # noqa: F811
    """/flush_cache (Scheduler.flush_cache) also empties the text finished requests left for text
    matching; its device copy keeps its size (no new program shape)."""
    from jaxspec.speculative.proposers.ngram import SEP

    eng = engine(models, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    sched = serve_scheduler(eng, PROMPTS[:2], GREEDY)
    size = eng.dparams["corpus"].shape
    assert len(eng._corpus.buf) > 0 and np.any(np.asarray(eng.dparams["corpus"]) != SEP)
    sched.flush_cache()
    assert len(eng._corpus.buf) == 0 and eng.dparams["corpus"].shape == size
    assert np.all(np.asarray(eng.dparams["corpus"]) == SEP)

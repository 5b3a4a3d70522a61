"""EAGLE-3 draft vocabularies: the size chosen by coverage, and a trained head widened without
training (old rows kept exactly, new rows the fitted linear image of the target's rows, output still
lossless)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.train.vocab import coverage, extend_head, fit_row_map, retarget, token_counts, vocab_for_coverage

from helpers import make_hf_model, save_eagle_head


def test_retarget_trades_unused_tokens_for_frequent_missing_ones():
    have = np.arange(0, 40, 2)  # 20 even tokens of a 64-token vocabulary
    counts = np.zeros(64, np.int64)
    counts[[0, 2, 4]] = 5  # used, kept
    counts[[1, 3, 5, 7]] = [9, 2, 7, 6]  # lacking: 1, 5 and 7 occur often enough (min_count 3), 3 does not
    counts[50] = 4  # lacking too, the least frequent of those that qualify
    vocab, src = retarget(have, counts, max_new=3, min_count=3, keep=[38])
    assert len(vocab) == 20 and (np.diff(vocab) > 0).all()
    assert set(vocab) - set(have) == {1, 5, 7}  # the most frequent three (50 waits: max_new)
    assert set(have) - set(vocab) == {32, 34, 36}  # unused, the highest ids first, 38 kept as asked
    assert (vocab[src >= 0] == have[src[src >= 0]]).all() and set(vocab[src < 0]) == {1, 5, 7}
    same, src = retarget(have, counts, max_new=0)
    assert (same == have).all() and (src == np.arange(20)).all()
    counts[have] = 1  # every token of the vocabulary used: nothing to give up
    same, src = retarget(have, counts, max_new=3, min_count=3)
    assert (same == have).all() and (src >= 0).all()


def test_vocab_for_coverage_picks_the_fewest_tokens_that_cover():
    # token i occurs 1000 - i times: the first k tokens cover a known share
    counts = token_counts([np.repeat(np.arange(1000), 1000 - np.arange(1000))], 1024)
    assert counts[0] == 1000 and counts[999] == 1 and counts[1000:].sum() == 0
    for want in (0.3, 0.75, 0.99):
        ids = vocab_for_coverage(counts, want, lo=8, hi=1024, multiple=8)
        assert coverage(counts, ids) >= want and coverage(counts, ids[:-8]) < want  # the fewest (in steps of 8)
        assert len(ids) % 8 == 0 and (np.diff(ids) > 0).all() and set(ids) == set(range(len(ids)))
    assert len(vocab_for_coverage(counts, 1.0, lo=8, hi=512, multiple=8)) == 512  # capped
    assert len(vocab_for_coverage(counts, 0.01, lo=64, hi=512, multiple=8)) == 64  # at least lo
    assert 1020 in vocab_for_coverage(counts, 0.01, lo=64, hi=512, multiple=8, always=[1020])  # e.g. EOS


def test_fit_row_map_recovers_a_linear_map():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(400, 16)).astype(np.float32)
    m = rng.normal(size=(16, 16)).astype(np.float32)
    assert np.allclose(fit_row_map(e @ m, e, ridge=1e-6), m, atol=1e-3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab_target")
    hf = make_hf_model("llama", 2, vocab_size=400, num_hidden_layers=8)
    hf.save_pretrained(d)
    return str(d), hf


def test_extend_head_keeps_old_rows_and_stays_lossless(target_dir, tmp_path):
    from safetensors import safe_open

    from jaxspec.engine import Engine

    path, hf = target_dir
    head = save_eagle_head(tmp_path / "head", "EAGLE3", hf.config.to_dict(), draft_vocab=64)
    rows = hf.model.embed_tokens.weight.detach().numpy()  # tied: the target's output rows
    with safe_open(f"{head}/model.safetensors", "numpy") as f:
        old_w, old_d2t = f.get_tensor("lm_head.weight"), f.get_tensor("d2t")
    old_ids = np.arange(64) + old_d2t
    add = [i for i in range(400) if i not in set(old_ids)][:100] + list(old_ids[:5])  # 5 it already has
    summary = extend_head(head, rows, add, str(tmp_path / "wide"))
    assert summary["draft_vocab_before"] == 64 and summary["added"] == 100 and summary["draft_vocab_after"] == 164
    cfg = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 164
    with safe_open(f"{tmp_path}/wide/model.safetensors", "numpy") as f:
        w, d2t, t2d = f.get_tensor("lm_head.weight"), f.get_tensor("d2t"), f.get_tensor("t2d")
        assert np.array_equal(
            f.get_tensor("fc.weight"), safe_open(f"{head}/model.safetensors", "numpy").get_tensor("fc.weight")
        )
    ids = np.arange(164) + d2t
    assert (np.diff(ids) > 0).all() and set(old_ids) <= set(ids) and t2d.sum() == 164 and t2d[ids].all()
    where = {t: i for i, t in enumerate(ids)}
    assert np.array_equal(w[[where[t] for t in old_ids]], old_w)  # the trained rows, unchanged
    m = fit_row_map(old_w, rows[old_ids])
    new = [t for t in ids if t not in set(old_ids)]
    assert np.allclose(w[[where[t] for t in new]], rows[new] @ m, atol=1e-4)

    plain = Engine(path, skip_tokenizer_init=True, show_progress=False, speculative_algorithm="NONE")
    wide = Engine(
        path,
        skip_tokenizer_init=True,
        show_progress=False,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(tmp_path / "wide"),
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
    )
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = [[5, 6, 7], [11, 12, 13, 14]]
    assert [r["output_ids"] for r in wide.generate(input_ids=prompts, sampling_params=sp)] == [
        r["output_ids"] for r in plain.generate(input_ids=prompts, sampling_params=sp)
    ]
    with pytest.raises(JaxspecError, match="already has every token"):
        extend_head(head, rows, old_ids[:3], str(tmp_path / "none"))

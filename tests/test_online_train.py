"""Online draft training (jaxspec/speculative/online.py) on a tiny learnable target: an untrained
EAGLE-3 head adapts to the traffic it serves and is swapped in, output stays token-identical to
plain decoding, a failed step is dropped, and the saved head reloads with what it learned."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.loader import load

from helpers import make_hf_model, save_eagle_head

V = 64
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
GREEDY = dict(temperature=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    import torch

    d = tmp_path_factory.mktemp("online_target")
    hf = make_hf_model("llama", 7, vocab_size=V, num_hidden_layers=8, initializer_range=0.6)
    with torch.no_grad():  # learnable: the next token depends on the current one (as in test_train_draft)
        hf.model.norm.weight.mul_(6.0)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    hf.save_pretrained(d)
    head = save_eagle_head(tmp_path_factory.mktemp("online_head"), "EAGLE3", hf.config.to_dict(), draft_vocab=48)
    return str(d), head


def _engine(dirs, **kw):
    """An engine whose online training (when on) runs in a thread of the serving process, whose
    internals a test can reach, unless told otherwise."""
    target, head = dirs
    kw.setdefault("speculative_online_train_process", False)
    return Engine(
        target,
        skip_tokenizer_init=True,
        show_progress=False,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head,
        **CHAIN,
        **kw,
    )


def _accept(eng, prompts) -> float:
    got = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    return float(np.mean([r["meta_info"]["spec_accept_length"] for r in got])), [r["output_ids"] for r in got]


@pytest.mark.slow  # end to end (make test's 15 minutes)
def test_the_head_adapts_and_output_does_not_change(dirs, tmp_path):
    """In a second process (the default on the CPU): the head it trains is swapped into this one."""
    eng = _engine(
        dirs,
        speculative_online_train=True,
        speculative_online_train_process=True,
        speculative_online_train_lr=1e-2,
        speculative_online_train_share=1.0,
        speculative_online_train_swap_every=10,
    )
    from jaxspec.speculative.online_process import OnlineProcess

    assert isinstance(eng.online, OnlineProcess)
    rng = np.random.default_rng(0)
    probe = [list(rng.integers(0, V, 4)) for _ in range(6)]
    before, out_before = _accept(eng, probe)
    traffic = [list(rng.integers(0, V, 4)) for _ in range(160)]
    eng.generate(
        input_ids=traffic,
        sampling_params=[dict(temperature=1.0, max_new_tokens=28, ignore_eos=True, seed=i) for i in range(160)],
    )
    deadline = time.monotonic() + 240
    swapped = lambda s: s["draft_version"] >= 1 and s["online_train_last_swap"] is not None
    while not swapped(eng.online.stats()) and time.monotonic() < deadline:
        time.sleep(1)
    stats = eng.online.stats()
    assert stats["draft_version"] >= 1, stats
    # the scoring that swapped it in (later scorings go on while training does)
    swap = stats["online_train_last_swap"]
    assert swap["swapped"] and swap["candidate"] > swap["in_use"], swap
    after, out_after = _accept(eng, probe)
    plain = Engine(dirs[0], skip_tokenizer_init=True, show_progress=False, speculative_algorithm="NONE")
    expect = [r["output_ids"] for r in plain.generate(input_ids=probe, sampling_params=GREEDY)]
    assert out_before == expect and out_after == expect  # lossless before and after the swap
    assert after > before + 0.3, (before, after)
    eng.online.close()

    saved = eng.save_draft(str(tmp_path / "adapted"))
    fresh = Engine(
        dirs[0],
        skip_tokenizer_init=True,
        show_progress=False,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=saved,
        **CHAIN,
    )
    again, out_again = _accept(fresh, probe)
    assert out_again == expect and again > before + 0.3, (before, again)


def test_serving_outlives_the_training_process(dirs):
    """The training process killed mid-run: requests are still served, token-identical, with the
    head in use, and the stats still answer."""
    eng = _engine(dirs, speculative_online_train=True, speculative_online_train_process=True)
    rng = np.random.default_rng(4)
    probe = [list(rng.integers(0, V, 4)) for _ in range(4)]
    _, before = _accept(eng, probe)
    eng.online._proc.kill()
    eng.online._proc.wait(30)
    _, after = _accept(eng, probe)
    assert after == before
    assert eng.online.stats()["draft_version"] == 0
    eng.online.close()


def test_a_target_given_in_memory_trains_in_a_thread(dirs):
    """The training process loads the target from its path: a target given in memory has none, so
    training runs in a thread by default, and asking for the process is a clear error."""
    from jaxspec.speculative.online import OnlineTrainer

    model = load(dirs[0], with_tokenizer=False, progress=False).model
    kw = dict(
        skip_tokenizer_init=True,
        show_progress=False,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=dirs[1],
        speculative_online_train=True,
        **CHAIN,
    )
    eng = Engine.from_model(model, **kw)
    assert isinstance(eng.online, OnlineTrainer)
    eng.online.close()
    with pytest.raises(JaxspecError, match="given in memory"):
        Engine.from_model(model, speculative_online_train_process=True, **kw)


def test_a_failed_step_is_dropped(dirs, monkeypatch):
    eng = _engine(dirs, speculative_online_train=True, speculative_online_train_share=1.0)
    rng = np.random.default_rng(1)
    feats = np.zeros((24, 3 * eng.cfg.hidden_size), np.float32)
    for _ in range(20):
        eng.online.observe(list(rng.integers(0, V, 4)), list(rng.integers(0, V, 20)), feats)
    eng.online.close()  # no background thread work: this test drives the steps itself
    eng.online.train_steps(1)
    tr = eng.online._trainer
    good = np.asarray(tr.params["lm_head"]["kernel"][...]).copy()

    def nan_update(params, opt_state, *rest):
        import jax.numpy as jnp

        return params, opt_state, jnp.float32(np.nan), {}

    monkeypatch.setattr(tr, "update_given", nan_update)
    eng.online.train_steps(2)
    assert eng.online.stats()["online_train_failed_steps"] == 2
    assert np.array_equal(np.asarray(tr.params["lm_head"]["kernel"][...]), good)
    assert eng.online.stats()["online_train_steps"] == 1


def test_the_head_in_use_scores_each_held_back_group_once(dirs, monkeypatch):
    """Scoring reuses the weights in use's agreement on a full group of held-back requests until a
    swap, and gives the same scores as scoring everything afresh; a swapped-in copy's agreement
    stands for the new version."""
    from jaxspec.speculative import online

    eng = _engine(dirs, speculative_online_train=True, speculative_online_train_lr=1e-2)
    eng.online.close()  # this test drives the steps itself
    rng = np.random.default_rng(3)
    eng.generate(input_ids=[list(rng.integers(0, V, 4)) for _ in range(online.HOLDOUT * 20)], sampling_params=GREEDY)
    ol = eng.online
    assert len(ol.held) == 20  # two full groups of BATCH and a partial one
    ol.train_steps(1)
    tr = ol._trainer
    calls = []
    real = tr.eval_given
    monkeypatch.setattr(tr, "eval_given", lambda *a, **k: calls.append(1) or real(*a, **k))
    heads = ((ol._served, ol._served_vocab), (tr.params, tr.ids))
    fresh = ol._scores(tr, list(ol.held), heads)[0]
    assert len(calls) == 6  # 3 groups x 2 heads
    calls.clear()
    cache: dict = {}
    assert ol._scores(tr, list(ol.held), heads, cache=cache)[0] == fresh and len(calls) == 6
    calls.clear()
    assert ol._scores(tr, list(ol.held), heads, cache=cache)[0] == fresh
    assert len(calls) == 4  # the head in use: only the partial group again
    ol.train_steps(40)
    assert ol.score_and_swap()  # the copy's agreement on the two full groups now stands for the head in use
    assert sorted(ol._in_use_scores) == [(ol.version, 0), (ol.version, 1)]
    calls.clear()
    ol.score_and_swap()
    assert len(calls) == 4


def test_the_draft_vocabulary_follows_the_traffic(dirs):
    """Tokens the served outputs use and the head's vocabulary lacks take the places of tokens no
    output uses; a kept token keeps its LM-head row, a new one starts with fresh optimizer moments;
    the head swapped in drafts over the new vocabulary, and output stays lossless."""
    import jax.numpy as jnp

    from jaxspec.speculative import online
    from jaxspec.train.vocab import token_counts

    eng = _engine(dirs, speculative_online_train=True, speculative_online_train_lr=1e-2)
    eng.online.close()  # this test drives the steps itself
    rng = np.random.default_rng(5)
    probe = [list(rng.integers(0, V, 4)) for _ in range(6)]
    eng.generate(input_ids=[list(rng.integers(0, V, 4)) for _ in range(60)], sampling_params=GREEDY)
    eng.online.train_steps(1)
    tr = eng.online._trainer
    old, kernel = tr.ids.copy(), np.asarray(tr.params["lm_head"]["kernel"][...]).copy()
    counts = token_counts([r.ids[r.mask > 0] for r in eng.online.examples], V)
    assert eng.online.revise_vocab() > 0
    new = tr.ids
    assert len(new) == len(old) and (np.diff(new) > 0).all()
    added, dropped = set(new) - set(old), set(old) - set(new)
    assert added and all(counts[t] >= online.VOCAB_MIN_COUNT for t in added)
    assert dropped and all(counts[t] == 0 for t in dropped) and len(added) == len(dropped)
    moved = np.asarray(tr.params["lm_head"]["kernel"][...])
    mu = np.asarray(tr.opt_state[1].mu["lm_head"]["kernel"][...])
    for d, t in enumerate(new):
        if t in added:
            assert not mu[:, d].any()
        else:
            np.testing.assert_array_equal(moved[:, d], kernel[:, list(old).index(t)])
    labels = np.asarray(tr._labels(jnp.asarray([[0, int(max(added))]]), jnp.asarray(new)))
    assert labels[0, 0] == list(new).index(max(added))  # the new token is a label now
    assert eng.online.stats()["online_train_vocab_replaced"] == len(added)

    eng.online.train_steps(40)
    assert eng.online.score_and_swap()
    d2t = np.asarray(eng.dparams["draft"]["d2t"][...])
    assert (d2t + np.arange(len(d2t)) == new).all()  # the engine drafts over the new vocabulary
    plain = Engine(dirs[0], skip_tokenizer_init=True, show_progress=False, speculative_algorithm="NONE")
    expect = [r["output_ids"] for r in plain.generate(input_ids=probe, sampling_params=GREEDY)]
    assert _accept(eng, probe)[1] == expect


def _recomputed(eng, ids) -> np.ndarray:
    """The target's EAGLE-3 features over ids [n] by a forward of its own -> [n, 3H]."""
    import jax.numpy as jnp

    from jaxspec.train.data import Example
    from jaxspec.train.trainer import TrainConfig, Trainer

    online = eng.online
    tr = Trainer(
        eng.loaded, online_head_config(online), [Example(list(ids), [1] * len(ids))], TrainConfig(),
        "/tmp/unused", progress=False, init_head=online.head_path,
    )  # fmt: skip
    return np.asarray(tr._features(tr._tgt_params, jnp.asarray([ids]))[0][0])


def online_head_config(online):
    from jaxspec.speculative.online import _head_config

    return _head_config(online.head_path)


def check_kept_features(eng, n_min: int) -> int:
    """Every request online training holds: its features, kept by serving, are the target's own
    at the same positions (bf16). Returns how many requests were checked."""
    recs = list(eng.online.examples) + list(eng.online.held)
    assert len(recs) >= n_min
    for r in recs:
        got = r.features().astype(np.float32)
        want = _recomputed(eng, [int(t) for t in r.ids])[: len(r.ids) - 2]
        assert got.shape == want.shape, (got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))
    return len(recs)


def test_the_kept_features_are_the_targets(dirs):
    """Features read back from the draft cache after prefill chunks and rounds match a fresh
    forward over the same tokens, row for row (prompts of several chunks, and longer than the
    training window, whose tail is kept)."""
    from jaxspec.speculative import online

    eng = _engine(dirs, speculative_online_train=True, chunked_prefill_size=16)
    eng.online.close()  # no training thread: this test reads the buffer
    rng = np.random.default_rng(3)
    old = online.MAX_LEN
    online.MAX_LEN = 40  # so that the longer prompts exercise the tail window
    try:
        prompts = [list(rng.integers(0, V, n)) for n in (5, 23, 37, 50)]
        eng.generate(input_ids=prompts, sampling_params=[dict(GREEDY, max_new_tokens=12 + i) for i in range(4)])
        assert check_kept_features(eng, 4) == 4
        assert [len(r.ids) for r in list(eng.online.examples) + list(eng.online.held)] == [17, 36, 40, 40]
    finally:
        online.MAX_LEN = old


def test_scoring_only_the_output_rows_is_the_same_loss(dirs):
    """The training-time-test loss over a window of rows around each request's output (what online
    training computes) equals the loss over every row, in value, metrics and gradient."""
    import jax
    import jax.numpy as jnp

    from jaxspec.speculative.online import Served, pad_served, query_rows

    eng = _engine(dirs, speculative_online_train=True)
    eng.online.close()
    rng = np.random.default_rng(4)
    f = 3 * eng.cfg.hidden_size
    recs = []
    for n_prompt, n_out in ((70, 9), (20, 30), (100, 20)):
        n = n_prompt + n_out
        mask = np.r_[np.zeros(n_prompt), np.ones(n_out)].astype(np.float32)
        recs.append(Served(rng.integers(0, V, n).astype(np.int32), mask, rng.standard_normal((n - 2, f)) * 3))
    eng.online.examples.extend(recs * 6)
    tr = eng.online._build()
    length = 128
    ids, mask, feats = (jnp.asarray(x) for x in pad_served(recs, length))
    first, nq = query_rows(recs, length, eng.online.depth)
    assert nq == 32 and list(first) == [66, 16, 96]  # the last window moves back to fit: rows 95 .. 126
    labels = tr._labels(ids)
    full = lambda p: tr._loss(p, tr.rest, tr._tgt_params, ids, mask, feats.astype(jnp.float32), labels)
    part = lambda p: tr._loss(
        p, tr.rest, tr._tgt_params, ids, mask, feats.astype(jnp.float32), labels, (jnp.asarray(first), nq)
    )
    (l1, m1), g1 = jax.value_and_grad(full, has_aux=True)(tr.params)
    (l2, m2), g2 = jax.value_and_grad(part, has_aux=True)(tr.params)
    assert float(l1) > 0 and abs(float(l1) - float(l2)) < 1e-4 * float(l1)
    for k in m1:
        assert abs(float(m1[k]) - float(m2[k])) < 1e-4, (k, m1[k], m2[k])
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5 * float(np.abs(a).max() + 1e-9))


def test_bad_settings_are_refused(dirs):
    with pytest.raises(JaxspecError, match="EAGLE-3"):
        Engine(
            dirs[0], skip_tokenizer_init=True, show_progress=False, speculative_algorithm="NGRAM",
            speculative_online_train=True,
        )  # fmt: skip
    with pytest.raises(JaxspecError, match="share"):
        _engine(dirs, speculative_online_train=True, speculative_online_train_share=0)
    with pytest.raises(JaxspecError, match="speculative_online_train"):
        _engine(dirs).save_draft("/tmp/nowhere")
    loaded = load(dirs[0], with_tokenizer=False, progress=False)
    with pytest.raises(JaxspecError, match="unquantized"):
        Engine(
            _loaded=loaded, show_progress=False, quantization="int8", speculative_algorithm="EAGLE3",
            speculative_draft_model_path=dirs[1], speculative_online_train=True, **CHAIN,
        )  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny target with SmolLM2's tokenizer (the server loads one) and an EAGLE-3 head for it."""
    from transformers import AutoTokenizer

    from jaxspec.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path(progress=False))
    d = tmp_path_factory.mktemp("online_served")
    kw = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    hf = make_hf_model("llama", 5, num_hidden_layers=8, max_position_embeddings=512, **kw)
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    head = save_eagle_head(
        tmp_path_factory.mktemp("online_served_head"), "EAGLE3", hf.config.to_dict(), draft_vocab=256
    )
    return str(d), head


@pytest.mark.slow  # about a minute: a server start
def test_the_server_shows_and_saves_the_head(served, tmp_path):
    from helpers import start

    dirs = served
    srv = start(
        {"target": dirs[0]},
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=dirs[1],
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        speculative_online_train=True,
        speculative_online_train_share=0.1,
        speculative_online_train_process=False,  # a thread, so that the test can read its buffer
    )
    try:
        for i in range(6):
            body = {"input_ids": [1 + i, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            status, out, _ = srv.request("POST", "/generate", body)
            assert status == 200, out
        status, info, _ = srv.request("GET", "/get_server_info")
        assert status == 200 and info["draft_version"] == 0
        state = info["internal_states"][0]
        assert state["online_train_buffer"] + state["online_train_held_out"] >= 6  # (and start-up's own requests)
        # the features the server read back from its slots are the target's (prefix cache included)
        check_kept_features(srv.sched.eng, 6)
        status, text, _ = srv.request("GET", "/metrics")
        assert "jaxspec:draft_version" in text and "jaxspec:online_train_steps_total" in text
        status, out, _ = srv.request("POST", "/save_draft", {"path": str(tmp_path / "head")})
        assert status == 200 and out["draft_version"] == 0, out
        assert (tmp_path / "head" / "model.safetensors").exists() and (tmp_path / "head" / "config.json").exists()
        status, out, _ = srv.request("POST", "/save_draft", {"path": "/proc/no/such/dir"})
        assert status == 400, out
        status, out, _ = srv.request("POST", "/save_draft", {})
        assert status == 400, out
    finally:
        srv.stop()

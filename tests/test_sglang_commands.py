"""The commands of SGLang's speculative-decoding documentation, with `python3 -m sglang.launch_server`
replaced by `jaxspec serve` and the model / draft paths by tiny local ones: every one parses, and
the engine it describes starts and decodes losslessly (greedy equal to the same target's plain
decoding)."""

from __future__ import annotations

import logging
import shlex

import pytest

from jaxspec.args import EngineArgs, ServerArgs
from jaxspec.cli import build_parser
from jaxspec.cli_flags import from_namespace
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError

from helpers import GREEDY, PROMPTS, models  # noqa: F401  (models: fixture)

# (name, arguments after `serve`, with TARGET / DRAFT / SMALL / MAP standing for local paths,
#  the environment it sets, the tree shape jaxspec runs)
COMMANDS = [
    (
        "eagle2",
        "--model TARGET --speculative-algorithm EAGLE --speculative-draft-model-path DRAFT "
        "--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 "
        "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
        {},
        (3, 4, 16),
    ),
    (
        "eagle2-torch-compile",
        "--model TARGET --speculative-algorithm EAGLE --speculative-draft-model-path DRAFT "
        "--speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 "
        "--mem-fraction-static 0.7 --enable-torch-compile --torch-compile-max-bs 2 --log-level warning",
        {},
        (5, 8, 64),
    ),
    (
        "eagle2-fr-spec",
        "--model TARGET --speculative-algorithm EAGLE --speculative-draft-model-path DRAFT "
        "--speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 "
        "--speculative-token-map MAP --mem-fraction-static 0.7 --cuda-graph-max-bs 2 --dtype float16 "
        "--log-level warning",
        {},
        (5, 8, 64),
    ),
    (
        "eagle3",
        "--model TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT3 "
        "--speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 32 "
        "--mem-fraction-static 0.6 --cuda-graph-max-bs 2 --dtype float16 --log-level warning",
        {},
        (5, 8, 32),
    ),
    (
        "mtp",  # the MiMo-7B-RL example's flags and shape; the draft is an EAGLE head here (MTP layouts: test_mtp.py)
        "--model TARGET --host 0.0.0.0 --trust-remote-code --speculative-algorithm EAGLE "
        "--speculative-draft-model-path DRAFT --speculative-num-steps 1 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 2 --mem-fraction-static 0.5 --log-level warning",
        {},
        (1, 1, 2),
    ),
    (
        "eagle3-decode-attention",  # the parameter reference's attention flags
        "--model TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT3 "
        "--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 "
        "--speculative-attention-mode decode --speculative-draft-attention-backend xla --log-level warning",
        {},
        (3, 4, 16),
    ),
    (
        "standalone",
        "--model TARGET --speculative-algorithm STANDALONE --speculative-draft-model-path SMALL "
        "--speculative-num-steps 4 --speculative-eagle-topk 2 --speculative-num-draft-tokens 7 "
        "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
        {},
        (4, 2, 7),
    ),
    (
        "spec-v2",
        "--model TARGET --speculative-algorithm EAGLE --speculative-draft-model-path DRAFT "
        "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --log-level warning",
        {"SGLANG_ENABLE_SPEC_V2": "True"},
        (5, 1, 6),
    ),
    (
        "ngram",
        "--model TARGET --speculative-algorithm NGRAM --speculative-num-draft-tokens 16 "
        "--speculative-ngram-max-match-window-size 12 --speculative-ngram-max-bfs-breadth 10 "
        "--mem-fraction-static 0.7 --cuda-graph-max-bs 8 --log-level warning",
        {"SGLANG_NGRAM_FORCE_GREEDY_VERIFY": "1"},
        (15, 1, 16),
    ),
    (
        "oom-recovery",
        "--model-path TARGET --speculative-algorithm EAGLE --speculative-draft-model-path DRAFT "
        "--speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 8 "
        "--quantization fp8 --speculative-draft-model-quantization unquant --mem-fraction-static 0.7",
        {},
        (2, 2, 7),  # N lowered to the 7 nodes a (2, 2) tree holds
    ),
]


@pytest.fixture(scope="module")
def paths(models, tmp_path_factory):  # noqa: F811
    token_map = tmp_path_factory.mktemp("map") / "freq.npy"
    import numpy as np

    np.save(token_map, np.arange(12))
    return {
        "TARGET": models["target"],
        "DRAFT": models["eagle"],
        "DRAFT3": models["eagle3"],
        "SMALL": models["small"],
        "MAP": str(token_map),
    }


def parse(cmd: str, paths: dict):
    argv = ["serve"] + [paths.get(a, a) for a in shlex.split(cmd)]
    ns = build_parser().parse_args(argv)
    return from_namespace(EngineArgs, ns), from_namespace(ServerArgs, ns)


@pytest.mark.parametrize("name,cmd,env,shape", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_parses_and_resolves(paths, monkeypatch, caplog, name, cmd, env, shape):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    eargs, sargs = parse(cmd, paths)
    eargs.validate()
    sargs.validate()
    from jaxspec.args import compatibility_notes

    notes = compatibility_notes(eargs, sargs)
    if "--trust-remote-code" in cmd:
        assert any("runs no code" in n for n in notes)
    if "--enable-torch-compile" in cmd:
        assert any("compiled by XLA" in n for n in notes)
    if "SGLANG_ENABLE_SPEC_V2" in env:
        assert any("overlap scheduler" in n for n in notes)
    if "SGLANG_NGRAM_FORCE_GREEDY_VERIFY" in env:
        assert eargs.ngram_force_greedy_verify


@pytest.mark.slow
@pytest.mark.parametrize("name,cmd,env,shape", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_starts_and_is_lossless(paths, monkeypatch, name, cmd, env, shape):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    eargs, _ = parse(cmd, paths)
    eng = Engine(eargs, skip_tokenizer_init=True, show_progress=False)
    s = eng.spec
    assert (s.num_steps, s.eagle_topk, s.num_draft_tokens) == shape
    plain_args = EngineArgs(
        model_path=eargs.model_path, dtype=eargs.dtype, quantization=eargs.quantization, speculative_algorithm="NONE"
    )
    plain = Engine(plain_args, skip_tokenizer_init=True, show_progress=False)
    sp = dict(GREEDY, max_new_tokens=12)
    want = [r["output_ids"] for r in plain.generate(input_ids=PROMPTS[:2], sampling_params=sp)]
    assert [r["output_ids"] for r in eng.generate(input_ids=PROMPTS[:2], sampling_params=sp)] == want


def test_conflicting_and_unknown_values_get_errors(paths, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "1")
    _, sargs = parse("--model TARGET --disable-overlap-schedule", paths)
    with pytest.raises(JaxspecError, match="overlap"):
        sargs.validate()
    with pytest.raises(SystemExit):
        parse("--model TARGET --speculative-attention-mode sideways", paths)
    with caplog.at_level(logging.WARNING, logger="jaxspec"):
        eargs, _ = parse(
            "--model TARGET --speculative-algorithm EAGLE --speculative-draft-model-path DRAFT "
            "--speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 8",
            paths,
        )
        eng = Engine(eargs, skip_tokenizer_init=True, show_progress=False)
    assert eng.spec.num_draft_tokens == 7 and "lowered to 7" in caplog.text


def test_multi_layer_eagle_needs_an_mtp_chain(paths):
    """Accepted with EAGLE / NEXTN (tests/test_mtp_multi_layer.py runs it); refused with an algorithm
    that has no MTP layers to draft with, or with a tree (topk > 1)."""
    parse("--model TARGET --speculative-algorithm NEXTN --enable-multi-layer-eagle", paths)[0].validate()
    eargs, _ = parse("--model TARGET --speculative-algorithm EAGLE3 --enable-multi-layer-eagle", paths)
    with pytest.raises(JaxspecError, match="needs --speculative-algorithm EAGLE or NEXTN"):
        eargs.validate()
    eargs, _ = parse(
        "--model TARGET --speculative-algorithm EAGLE --enable-multi-layer-eagle --speculative-num-steps 3 "
        "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16",
        paths,
    )
    with pytest.raises(JaxspecError, match="needs --speculative-eagle-topk 1"):
        eargs.validate()
    eargs, _ = parse("--model TARGET --enable-multi-layer-eagle --speculative-algorithm NONE", paths)
    eargs.validate()  # nothing to draft with: nothing refused

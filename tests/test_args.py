"""Every flag is declared once (jaxspec/args.py) and shows up everywhere it should: in the --help of
each command that takes it, in the flag table of docs/flags.md, and with SGLang's names and defaults."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from jaxspec.args import EngineArgs, ModelArgs, ServerArgs, SpeculativeArgs, build
from jaxspec.cli import build_parser
from jaxspec.cli_flags import option
from jaxspec.errors import JaxspecError
from jaxspec.flag_docs import COMMANDS, flag_table

FLAGS_DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "flags.md")

# SGLang's ServerArgs fields for the speculative flags jaxspec implements, with SGLang's defaults
# (written from the names and defaults of SGLang's server arguments, not from jaxspec/args.py).
SGLANG_SPECULATIVE = {
    "speculative_algorithm": None,
    "speculative_draft_model_path": None,
    "speculative_draft_model_revision": None,
    "speculative_draft_load_format": None,
    "speculative_num_steps": None,
    "speculative_eagle_topk": None,
    "speculative_num_draft_tokens": None,
    "speculative_accept_threshold_single": 1.0,
    "speculative_accept_threshold_acc": 1.0,
    "speculative_token_map": None,
    "speculative_ngram_min_bfs_breadth": 1,
    "speculative_ngram_max_bfs_breadth": 10,
    "speculative_ngram_match_type": "BFS",
    "speculative_ngram_capacity": 10 * 1000 * 1000,
}
# SGLang's names for the model and server flags jaxspec shares (defaults may differ: jaxspec's are sized
# for its own engine; tp_size, ep_size and max_running_requests are asserted)
SGLANG_SERVER = (
    "host",
    "port",
    "api_key",
    "served_model_name",
    "mem_fraction_static",
    "max_queued_requests",
    "num_continuous_decode_steps",
    "disable_overlap_schedule",
    "cuda_graph_max_bs",
    "disable_cuda_graph",
    "disable_radix_cache",
    "dp_size",
)
SGLANG_MODEL = (
    "model_path",
    "tokenizer_path",
    "context_length",
    "max_running_requests",
    "chunked_prefill_size",
    "attention_backend",
    "random_seed",
    "tp_size",
    "ep_size",
    "dtype",
    "log_level",
)


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sub.format_help()


@pytest.mark.parametrize("cls", list(COMMANDS))
def test_every_flag_is_in_the_help_of_its_commands(cls):
    for command in COMMANDS[cls]:
        text = _help(command)
        for f in dataclasses.fields(cls):
            assert option(f.name) in text, f"{option(f.name)} missing from `jaxspec {command} --help`"


def test_server_flags_only_where_they_apply():
    for command in ("generate", "bench"):
        text = _help(command)
        assert not [f.name for f in dataclasses.fields(ServerArgs) if re.search(rf"^  {option(f.name)}\b", text, re.M)]


def test_the_docs_flag_table_is_the_generated_one():
    with open(FLAGS_DOC) as f:
        doc = f.read()
    assert flag_table() in doc, (
        "docs/flags.md's flag table is stale: paste the output of jaxspec.flag_docs.flag_table()"
    )
    for cls in COMMANDS:
        for f in dataclasses.fields(cls):
            assert f"`{option(f.name)}`" in doc


def test_sglang_names_and_defaults():
    ours = {f.name: f.default for f in dataclasses.fields(SpeculativeArgs)}
    for name, default in SGLANG_SPECULATIVE.items():
        assert name in ours, name
        assert ours[name] == default, (name, ours[name], default)
    server = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(SGLANG_SERVER) <= server
    model = {f.name: f.default for f in dataclasses.fields(ModelArgs)}
    assert set(SGLANG_MODEL) <= set(model)
    assert model["tp_size"] == 1 and model["ep_size"] == 1 and model["max_running_requests"] is None


def test_parsed_flags_reach_the_dataclasses():
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "31000",
            "--speculative-algorithm",
            "NGRAM",
            "--speculative-ngram-capacity",
            "77",
            "--max-running-requests",
            "3",
            "--disable-overlap-schedule",
        ]
    )
    from jaxspec.cli_flags import from_namespace

    e = from_namespace(EngineArgs, args)
    s = from_namespace(ServerArgs, args)
    assert (e.speculative_algorithm, e.speculative_ngram_capacity, e.max_running_requests) == ("NGRAM", 77, 3)
    assert (s.port, s.disable_overlap_schedule, s.host) == (31000, True, "127.0.0.1")
    g = build_parser().parse_args(["generate", "--prompt", "x"])
    assert g.temperature == 0.0 and g.max_new_tokens == 128 and g.stop is None  # greedy on the command line


def test_engine_kwargs_are_the_flags():
    with pytest.raises(JaxspecError, match="unknown Engine argument 'speculative_num_step'"):
        build(EngineArgs, {"speculative_num_step": 3}, what="Engine argument")
    e = build(EngineArgs, {"speculative_algorithm": "eagle3", "context_length": 64})
    assert e.algorithm == "EAGLE3" and e.context_length == 64


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(speculative_algorithm="MAGIC"), "unknown speculative_algorithm"),
        (dict(speculative_algorithm="EAGLE", speculative_num_steps=3), "all three"),
        (dict(speculative_algorithm="STANDALONE"), "needs speculative_draft_model_path"),
        (dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="DFS"), "BFS or PROB"),
        (dict(speculative_algorithm="EAGLE3", speculative_accept_threshold_single=0.0), r"\(0, 1\]"),
        (dict(chunked_prefill_size=0), "chunked_prefill_size"),
        (dict(max_running_requests=0), "max_running_requests"),
    ],
)
def test_flags_are_checked_before_loading(kw, match):
    with pytest.raises(JaxspecError, match=match):
        EngineArgs(**kw).validate()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(port=0), "--port"),
        (dict(mem_fraction_static=1.5), "mem-fraction-static"),
        (dict(num_continuous_decode_steps=-1), "num-continuous-decode-steps"),
    ],
)
def test_server_flags_are_checked(kw, match):
    with pytest.raises(JaxspecError, match=match):
        ServerArgs(**kw).validate()


def test_unset_flags_keep_their_old_meaning():
    """An unset algorithm leaves the speculative knobs to the target (checked only if it ships a
    draft); None means the default, 0 means auto for the context length and the server's sizes."""
    EngineArgs(speculative_num_steps=3).validate()  # a target without a shipped draft ignores it
    EngineArgs(context_length=0).validate()
    ServerArgs(num_continuous_decode_steps=0, cuda_graph_max_bs=0).validate()
    e = build(EngineArgs, {"speculative_ngram_capacity": None, "chunked_prefill_size": None, "model_path": None})
    assert e.speculative_ngram_capacity == 10 * 1000 * 1000 and e.chunked_prefill_size == 512
    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    assert fields.index("model_path") < fields.index("speculative_algorithm")  # model flags first

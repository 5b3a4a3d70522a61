"""The `jaxspec` command line: help for every subcommand, JSON output, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EXE = [sys.executable, "-m", "jaxspec.cli"]


def run(*args, input=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(EXE + list(args), capture_output=True, text=True, input=input, env=env, timeout=600)


@pytest.mark.parametrize("sub", [[], ["convert"], ["generate"], ["serve"], ["bench"]])
def test_help(sub):
    r = run(*sub, "--help")
    assert r.returncode == 0 and "usage: jaxspec" in r.stdout


@pytest.mark.slow
def test_generate_json():
    r = run("generate", "--prompt", "The capital of France is", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["meta_info"]["completion_tokens"] == 5 and len(out["output_ids"]) == 5


@pytest.mark.slow
def test_interactive_reads_until_eof():
    r = run("generate", "--interactive", "--max-new-tokens", "4", input="hello\n")
    assert r.returncode == 0, r.stderr
    assert "bot>" in r.stdout


@pytest.mark.parametrize(
    "args,match",
    [
        (["generate", "--model-path", "/no/such", "--prompt", "x"], "does not exist"),
        (["generate", "--prompt", "x", "--top-p", "0"], "top_p"),
        (["generate"], "exactly one of"),
        (["convert", "/no/such", "/tmp/out"], "does not exist"),
    ],
)
def test_user_errors_are_one_line(args, match):
    r = run(*args)
    assert r.returncode == 2
    assert match in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("jaxspec: error")]) == 1


@pytest.mark.slow
def test_serve_bad_flags_are_one_line():
    r = run("serve", "--port", "0")
    assert r.returncode == 2 and "--port" in r.stderr and "Traceback" not in r.stderr
    r = run("serve", "--speculative-algorithm", "NONE", "--mem-fraction-static", "1e-9")
    assert r.returncode == 2 and "out of memory" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_sweep(tmp_path):
    r = run(
        "bench",
        "--prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--baseline",
        "--speculative-algorithm",
        "STANDALONE",
        "--speculative-draft-model-path",
        "default",
        "--output-file",
        str(tmp_path / "rows.json"),
    )
    assert r.returncode == 0, r.stderr
    rows = json.load(open(tmp_path / "rows.json"))
    assert [x["algorithm"] for x in rows] == ["NONE", "STANDALONE"]
    assert rows[1]["accept_length"] > 2.0 and rows[1]["tokens_per_s"] > 0  # self-draft accepts (nearly) everything


@pytest.mark.slow
def test_bench_rejects_partial_knobs():
    r = run("bench", "--steps", "3", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "x")
    assert r.returncode == 2 and "all three" in r.stderr


@pytest.mark.slow
def test_train_draft_cli(tmp_path):
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Count to {i}."},
                {"role": "assistant", "content": " ".join(map(str, range(1, i + 2)))},
            ]
        }
        for i in range(9)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in chats))
    out = tmp_path / "head"
    r = run(
        "train-draft",
        "--data",
        str(data),
        "--num-samples",
        "5",
        "--eval-samples",
        "1",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--max-len",
        "64",
        "--draft-vocab-size",
        "256",
        "--ttt-steps",
        "2",
        "--save-every",
        "2",
        "--out",
        str(out),
        "--mix-original",
        "3",
        "--mix-data",
        str(data),
    )
    assert r.returncode == 0, r.stderr
    assert "8 training conversations" in r.stdout  # 5 + 1 read, 1 held out, 3 mixed in
    for f in ("config.json", "model.safetensors", "train_log.json", "loss.svg", "eval.json"):
        assert (out / f).exists(), f
    assert json.load(open(out / "config.json"))["architectures"] == ["LlamaForCausalLMEagle3"]
    r = run(
        "generate",
        "--prompt",
        "1 2 3",
        "--max-new-tokens",
        "4",
        "--json",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["meta_info"]["spec_verify_ct"] >= 1


@pytest.mark.slow
def test_train_draft_bad_data(tmp_path):
    r = run("train-draft", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not found" in r.stderr


def test_commands_other_than_serve_need_no_web_stack():
    """convert, generate, bench and train-draft run where fastapi and uvicorn are not installed
    (a GPU machine without network, for one): only `jaxspec serve` loads them."""
    code = "import sys; sys.modules['fastapi'] = sys.modules['uvicorn'] = None; import jaxspec.cli, jaxspec.train.cli"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

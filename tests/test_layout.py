"""The source tree's layout rules, checked from the text alone (no project module is imported).

- The import graph of jaxspec/, convert/, server/ and pallas_kernels/ runs one way: no cycle, counting
  every import statement, also those inside functions, so that no import is lazy to dodge a cycle.
- The imports that run when a module is loaded (module level, outside `if TYPE_CHECKING:`) have no
  cycle either once a package's __init__ is counted: importing `jaxspec.errors` from convert runs
  jaxspec/__init__.py first, which Python does before the module asked for.
- Code and docs describe the code, not its history: no issue numbers, no citing DESIGN.md / STYLE.md.
"""

from __future__ import annotations

import ast
import functools
import itertools
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxspec", "convert", "server", "pallas_kernels")
DOCS = ("README.md", os.path.join("benchmarks", "RESULTS.md"), "docs")
FORBIDDEN = re.compile(r"\bissues? #?\d+|\b(?:DESIGN|STYLE)\.md\b", re.IGNORECASE)


@functools.cache
def _modules() -> dict[str, str]:
    """Module name -> file; a package's __init__.py is the package module."""
    mods = {}
    for pkg in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    if pkg != "jaxspec":  # the top-level folders are jaxspec's subpackages
                        name = f"jaxspec.{name}"
                    mods[name.removesuffix(".__init__")] = path
    return mods


@functools.cache
def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _resolve(name: str, mods: dict[str, str]) -> str | None:
    """The project module an import of `name` loads: the longest prefix that is a module."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, eager_only: bool):
    """Import statements; eager_only: just those that run when the module is loaded."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        for child in ast.iter_child_nodes(node):
            if eager_only and (
                isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                or (isinstance(child, ast.If) and _is_type_checking(child))
            ):
                continue
            stack.append(child)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, mods: dict[str, str]):
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            pkg = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        # `from a.b import c` loads module a.b.c where there is one, else a.b
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    for name in names:
        target = _resolve(name, mods)
        if target:
            yield target


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(eager_only: bool = False, with_packages: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module: line}. with_packages: an import of a.b.c from outside package a
    (or a.b) also runs a/__init__.py (and a/b/__init__.py) first: edges to those packages."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        tree = _parse(path)
        is_package = path.endswith("__init__.py")
        loaded = {module, *_ancestors(module)}  # already initialised (or under way) when `module` runs
        for node in _imports(tree, eager_only):
            for target in _targets(node, module, is_package, mods):
                extra = [a for a in _ancestors(target) if a not in loaded] if with_packages else []
                for t in [*extra, target]:
                    if t != module:
                        graph[module].setdefault(t, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle [m0, m1, ..., m0] if there is any (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        its = [iter(sorted(graph[start]))]
        state[start] = 1
        while its:
            nxt = next(its[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                its.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                its.append(iter(sorted(graph[nxt])))
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    mods = _modules()
    return "\n".join(
        f"  {a} ({os.path.relpath(mods[a], ROOT)}:{graph[a][b]}) imports {b}" for a, b in itertools.pairwise(cycle)
    )


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 50, "the import graph came out (almost) empty"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (counting imports inside functions too):\n" + _describe(cycle, graph)


def test_import_time_graph_has_no_cycle_through_package_inits():
    graph = import_graph(eager_only=True, with_packages=True)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle when modules load (a package means its __init__.py):\n" + _describe(
        cycle, graph
    )


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def _text_files():
    for pkg in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            yield from (os.path.join(d, f) for f in files if f.endswith(".py"))
    for doc in DOCS:
        path = os.path.join(ROOT, doc)
        if os.path.isdir(path):
            for d, _, files in os.walk(path):
                yield from (os.path.join(d, f) for f in files if f.endswith((".md", ".txt", ".rst")))
        elif os.path.exists(path):
            yield path


def test_no_issue_numbers_or_process_documents_cited():
    hits = []
    for path in _text_files():
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                for m in FORBIDDEN.finditer(line):
                    hits.append(f"  {os.path.relpath(path, ROOT)}:{lineno}: {m.group(0)!r}")
    assert not hits, "say what the code does, not which issue or process document asked for it:\n" + "\n".join(hits)

"""Import directions between the repository's packages, read from the source (nothing is imported).

    pallas_kernels  <-  k3  <-  launch, experiments

Kernels import no model code (their benchmark scripts, `pallas_kernels/bench_*.py`, compare them
with the library's references and may); the library imports neither its entry points (`launch`) nor
its experiments; and no two modules of the library import each other, directly or around a loop, at
module level (a submodule naming its own parent package is not a loop: Python runs the parent first).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("k3", "pallas_kernels", "launch", "experiments")
# Scripts exempt from their package's rule.
SCRIPTS = ("pallas_kernels.bench_",)
# package -> the repository packages it must never import (at any level, lazily included)
FORBIDDEN = {
    "pallas_kernels": {"k3", "launch", "experiments"},
    "k3": {"launch", "experiments"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules=()) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import statement of a file. ``from m import x``
    counts as m.x when that is one of ``modules`` (x is a submodule), else as m."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub if sub in modules else node.module, id(node) in top))
    return out


def _sources():
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _importlib_targets(path: Path) -> list[str]:
    """String arguments of ``importlib.import_module("...")`` calls (lazy imports by name)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append(node.args[0].value)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_wrong_way_imports(package):
    """No module of ``package`` imports a package it must not (eager, lazy, or through importlib)."""
    bad = []
    for name, path in _sources().items():
        if name.split(".")[0] != package or name.startswith(SCRIPTS):
            continue
        targets = [m for m, _ in _imports(path)] + _importlib_targets(path)
        bad += [f"{name} imports {t}" for t in targets if t.split(".")[0] in FORBIDDEN[package]]
    assert not bad, bad


def test_no_module_level_import_cycles():
    """The module-level import graph of k3 and pallas_kernels has no cycle."""
    sources = {n: p for n, p in _sources().items() if n.split(".")[0] in ("k3", "pallas_kernels")}
    graph = {n: {m for m, top in _imports(p, sources) if top and m in sources and not (n + ".").startswith(m + ".")}
             for n, p in sources.items()}
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_the_checker_sees_a_wrong_way_import(tmp_path):
    """The parser finds eager, lazy and importlib imports (so the tests above can fail)."""
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom k3.mla.layer import ATTENTION\n\ndef f():\n    from launch import cli\n"
                 "    import importlib\n    return importlib.import_module('experiments.fit')\n")
    found = dict(_imports(f, {"launch.cli"}))
    assert found["k3.mla.layer"] is True and found["launch.cli"] is False
    assert _importlib_targets(f) == ["experiments.fit"]

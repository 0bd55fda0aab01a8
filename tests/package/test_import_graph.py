"""The package's import structure: no import loop among its modules, and every module imports on its own.

- The graph: one node per module of ``megatron_gigpo``; an edge for every import statement naming another
  module of the package, wherever it is written (module level, inside a function, under
  ``if TYPE_CHECKING:``), to the module it names (``from megatron_gigpo.algo import group_stats`` names
  ``algo.group_stats``; ``from megatron_gigpo.config import Config`` names ``config``). Any strongly connected
  component of more than one module is a loop; the test lists each with its edges. Not edges, by design:
  look-ups by name at run time, after every module has been imported: a setting's registry named as
  ``"module:NAME"`` (:func:`megatron_gigpo.fields.choice`, read when a recipe is checked) and the environment
  table of :mod:`megatron_gigpo.envs.registry` (modules loaded by name when an environment is built). They
  are how a settings module names the registry that checks it without importing the code it configures.
- Alone: every module is imported in a fresh interpreter, one per module (``tests/package/import_alone.py``),
  so an import that works only in a lucky order (after another module of the package, or after some
  third-party submodule was imported elsewhere) fails here.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_gigpo"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` over every import statement of every module."""
    modules = {_module_name(p, package_dir): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the importing module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            child = next(successors, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return loops


def _describe(loop: list[str], graph: dict[str, set[str]]) -> str:
    members = set(loop)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in loop)


@pytest.mark.unit
def test_no_import_loop_among_the_package_modules():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50  # the package was found and read
    loops = import_loops(graph)
    assert not loops, "import loops:\n" + "\n".join(_describe(loop, graph) for loop in loops)


@pytest.mark.unit
def test_the_loop_finder_sees_imports_inside_functions_and_for_type_checking(tmp_path):
    """The check fails on a loop closed by an import inside a function or under ``TYPE_CHECKING``."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (package / "d.py").write_text("import pkg.a\n")
    assert import_loops(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (package / "c.py").write_text("")
    assert import_loops(import_graph(package)) == []


@pytest.mark.slow  # ~110 interpreter starts, most importing torch or megatron-core: 1-2 minutes on 2 cores
def test_every_module_imports_alone_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("import_alone.py")), str(PACKAGE)],
                         capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["modules"] == len(import_graph(PACKAGE))
    failed = report["failed"]
    assert not failed, "\n\n".join(f"{name}:\n{error[-1500:]}" for name, error in failed.items())

"""The code's shape, kept by tools: layers in the data flow's order, no import cycle, small rooms."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "reshard"

pytestmark = pytest.mark.pure


def test_import_linter_contracts_kept() -> None:
    """pyproject's [tool.importlinter] contracts, all kept: the layers of reshard/ in the data flow's order,
    and the rooms inside io/ and service/."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 broken" in proc.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle() -> None:
    """Module by module, imports inside functions included; `if TYPE_CHECKING:` imports are left out
    (they never run)."""
    graph = grimp.build_graph("reshard", exclude_type_checking_imports=True, cache_dir=None)
    # a package imports its submodules' parents implicitly; an `__init__` that re-exports a child is
    # not a cycle of the code, so edges from a package to its own children are dropped
    for m in list(graph.modules):
        for child in graph.find_children(m):
            if graph.direct_import_exists(importer=m, imported=child):
                graph.remove_import(importer=m, imported=child)
    assert _cycles(graph) == []


def test_rooms_are_small() -> None:
    """No file of reshard/ over 400 lines, no function over 60."""
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400:
            too_big.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_big == []


def test_module_names_are_used_once() -> None:
    """A module's file name says its role once: no two modules of reshard/ share a base name (packages'
    `__init__` and `__main__` aside), so `grep`, tracebacks and imports never leave a reader guessing."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_class_names_are_used_once() -> None:
    """A public class name says one thing: no two classes of reshard/ share it (a private `_Name` is local
    to its module), so `Layout` is the parallel layout and `Source` the checkpoint wherever they are read."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
    assert [p.split(":")[0] for p in seen["Layout"]] == ["reshard/layout/mesh.py"]
    assert [p.split(":")[0] for p in seen["Source"]] == ["reshard/format/checkpoint.py"]

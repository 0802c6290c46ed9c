"""The test suite's own shape: folders are packages, helpers live in tests/support, nothing edits sys.path,
no test imports another test module, a conftest or bench/ (tests/conftest.py checks the tier markers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

TESTS = Path(__file__).resolve().parent
# sys.path edits still to go, each with its reason (the file's owner removes it)
KNOWN_PATH_EDITS: dict[str, str] = {}
# the benchmark's own tests; fixtures both need live in reshard/testing (store servers, the MoE checkpoint)
BENCH_TESTS = {"test_bench_smoke.py"}


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(TESTS).as_posix()


def test_every_folder_is_a_package() -> None:
    folders = {p.parent for p in _modules()}
    assert sorted(_rel(f) or "." for f in folders if not (f / "__init__.py").exists()) == []


def test_helpers_live_in_support() -> None:
    loose = [_rel(p) for p in _modules() if p.parent.name != "support"
             and not (p.name.startswith("test_") or p.name in ("conftest.py", "__init__.py"))]
    assert loose == []


def _imported(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
    return out


def test_no_test_module_or_conftest_is_imported() -> None:
    bad = []
    for p in _modules():
        for name in _imported(ast.parse(p.read_text())):
            last = name.rsplit(".", 1)[-1]
            if name.startswith(".") or last == "conftest" or last.startswith("test_"):
                bad.append(f"{_rel(p)}: {name}")
    assert bad == []


def test_nothing_edits_sys_path() -> None:
    edits = {}
    for p in _modules():
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("sys.path") and node.attr in (
                    "insert", "append", "extend") or isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.path":
                edits.setdefault(_rel(p), node.lineno)
            if isinstance(node, ast.Name) and node.id == "pytest_plugins" or (
                    isinstance(node, ast.Attribute) and node.attr == "syspath_prepend"):
                edits.setdefault(_rel(p), node.lineno)
    assert {k: v for k, v in edits.items() if k not in KNOWN_PATH_EDITS} == {}


def test_no_test_imports_bench() -> None:
    bad = [f"{_rel(p)}: {name}" for p in _modules() if _rel(p) not in BENCH_TESTS
           for name in _imported(ast.parse(p.read_text())) if name == "bench" or name.startswith("bench.")]
    assert bad == []

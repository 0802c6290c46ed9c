"""`reshard.settings` and importing reshard: `import reshard` has no side effects (no transformers, no torch,
no file under HOME, no import hook), every `RESHARD_*` variable reshard reads is a settings field read
through `library_settings()` (or the service's settings class), and that accessor parses, checks and
re-reads the environment."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.errors import ReshardError
from reshard.settings import LibrarySettings, env_name, library_settings

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "reshard"
VARIABLE = re.compile(r"RESHARD_[A-Z][A-Z0-9_]*")

PROBE = """
import json, os, sys
import reshard
out = {"transformers": [m for m in sys.modules if m.startswith("transformers")], "torch": "torch" in sys.modules,
       "importcache": "reshard.importcache" in sys.modules,
       "finders": [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("reshard")],
       "cache": os.path.exists(os.path.expanduser("~/.cache/reshard"))}
reshard.enable_import_cache()  # the explicit switch: a finder, still no file until transformers is imported
out["enabled"] = [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("reshard")]
out["cache_after_enable"] = os.path.exists(os.path.expanduser("~/.cache/reshard"))
print(json.dumps(out))
"""


def test_import_reshard_has_no_side_effects(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESHARD_", "XDG_"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == {"transformers": [], "torch": False, "importcache": False, "finders": [], "cache": False,
                   "enabled": ["reshard.importcache"], "cache_after_enable": False}
    assert not (tmp_path / ".cache").exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def _settings_variables() -> set[str]:
    from reshard.service.serve_settings import Settings

    prefix = Settings.model_config["env_prefix"]
    return {env_name(f.name) for f in dataclasses.fields(LibrarySettings)} | {
        prefix + name.upper() for name in Settings.model_fields}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_reshard_variable_named_in_reshard_is_a_settings_field() -> None:
    fields = _settings_variables()
    assert {"RESHARD_PLAN_SOURCE", "RESHARD_TOKEN", "RESHARD_PREFETCH", "RESHARD_ROOT"} <= fields
    unknown = sorted(f"{p.relative_to(REPO)}: {name}" for p in _sources()
                     for name in set(VARIABLE.findall(p.read_text(encoding="utf-8"))) if name not in fields)
    assert unknown == [], "RESHARD_* variables that no settings class declares (add a field to reshard/settings.py):\n" \
        + "\n".join(unknown)


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and node.id == "environ"


def _env_reads(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    """(line, key) of every read of one variable: `environ.get(K)`, `getenv(K)`, `environ[K]`, `K in environ`."""
    reads: list[tuple[int, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute | ast.Name):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)) or \
                    getattr(f, "attr", getattr(f, "id", "")) == "getenv":
                reads.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and _is_environ(node.comparators[0]):
            reads.append((node.lineno, node.left))
    return reads


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    return {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


# reads whose key is a loop variable, each with what it runs over (checked below to hold no RESHARD_ name)
LOOPS = {("reshard/io/source/stores.py", "var"): ("reshard.io.source.stores", ("SECRET_VARS",)),
         ("reshard/io/source/stores.py", "v"): ("reshard.io.source.stores", ("_CONFIG_VARS",))}


def test_no_module_but_settings_reads_a_reshard_variable() -> None:
    import importlib

    wrong = []
    for path in _sources():
        if path == PACKAGE / "settings.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts, rel = _constants(tree), str(path.relative_to(REPO))
        for line, key in _env_reads(tree):
            value = consts.get(key.id) if isinstance(key, ast.Name) else key
            if isinstance(key, ast.Name) and (rel, key.id) in LOOPS:
                module, names = LOOPS[rel, key.id]
                value = ast.Constant(",".join(v for n in names for v in getattr(importlib.import_module(module), n)))
            if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                wrong.append(f"{rel}:{line}: reads the variable named by {ast.unparse(key)}")
            elif "RESHARD_" in value.value:
                wrong.append(f"{rel}:{line}: reads {value.value} itself")
    assert wrong == [], "read RESHARD_* variables through reshard.settings.library_settings():\n" + "\n".join(wrong)


def test_the_scan_sees_every_kind_of_read() -> None:
    code = 'import os\nA = "RESHARD_X"\nos.environ.get(A)\nos.getenv("B")\nos.environ["C"]\n"D" in os.environ\n'
    keys = [ast.unparse(k) for _, k in sorted(_env_reads(ast.parse(code)), key=lambda r: r[0])]
    assert keys == ["A", "'B'", "'C'", "'D'"]


def test_library_settings_parse_check_and_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for f in dataclasses.fields(LibrarySettings):
        monkeypatch.delenv(env_name(f.name), raising=False)
    assert library_settings() == LibrarySettings()
    assert (LibrarySettings().store_retries, LibrarySettings().store_multirange, LibrarySettings().t0) == (5, True, 0.0)
    monkeypatch.setenv("RESHARD_STORE_RETRIES", " 9 ")
    monkeypatch.setenv("RESHARD_STORE_MULTIRANGE", "Off")
    monkeypatch.setenv("RESHARD_STORE_ROWS", "slices")
    monkeypatch.setenv("RESHARD_T0", "1700000000.5")
    s = library_settings()
    assert (s.store_retries, s.store_multirange, s.store_rows, s.t0, s.store_timeout) == (9, False, "slices",
                                                                                          1700000000.5, 60.0)
    monkeypatch.setenv("RESHARD_STORE_RETRIES", "2")  # read again: a process may change them between calls
    assert library_settings().store_retries == 2
    for name, value, message in [("RESHARD_STORE_RETRIES", "-1", "RESHARD_STORE_RETRIES: -1 is less than 0"),
                                 ("RESHARD_STORE_RANGES", "2048", "RESHARD_STORE_RANGES: 2048 is greater than 1024"),
                                 ("RESHARD_STORE_TIMEOUT", "0", "RESHARD_STORE_TIMEOUT: 0.0 is not greater than 0"),
                                 ("RESHARD_STORE_ROWS", "rows", "RESHARD_STORE_ROWS: 'rows' is not one of auto, blocks"),
                                 ("RESHARD_STORE_MULTIRANGE", "maybe", "RESHARD_STORE_MULTIRANGE: not a boolean"),
                                 ("RESHARD_STORE_INFLIGHT", "lots", "RESHARD_STORE_INFLIGHT: invalid literal")]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(ReshardError) as e:
                library_settings()
            assert str(e.value).startswith(message) and str(e.value).endswith("(environment variable)")
    with pytest.raises(ReshardError, match="RESHARD_STORE_CONCURRENCY: 0 is less than 1"):
        LibrarySettings(store_concurrency=0)

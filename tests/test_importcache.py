"""`reshard.importcache`: transformers imported through the cache is the same transformers (its lazy
modules list the same names, the structure equals the one computed from the files), a second process
reads no source file, and any change to the walked tree (a file edited, added, removed), a corrupt
record or a cache directory that cannot be written gives transformers' own result."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from reshard import importcache

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from pathlib import Path
{install}
import transformers
import transformers.models
from transformers.utils import import_utils as iu
from transformers import LlamaForCausalLM
out = {{"top": sorted(dir(transformers)), "models": sorted(dir(transformers.models)),
        "llama": LlamaForCausalLM.__module__}}
if {installed}:
    original = iu.define_import_structure.__wrapped__.__wrapped__  # transformers' own (lru_cache'd)
    out["computed"] = original.cache_info().misses  # structures it computed in this process
    out["files_read"] = iu.create_import_structure_from_path.cache_info().misses
    models = Path(transformers.__file__).parent / "models"
    cached = iu.define_import_structure.__wrapped__  # without the lru_cache (transformers updates what it returned)
    out["equal"] = cached(models, prefix="models") == original.__wrapped__(models, "models")
print(json.dumps(out))
"""


def _probe(cache: Path, *, install: bool) -> dict[str, Any]:
    code = PROBE.format(install="from reshard import importcache; importcache.install()" if install else "",
                        installed=install)
    env = {**os.environ, importcache.DIR_ENV: str(cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_transformers_through_the_cache_is_transformers_and_a_second_import_reads_no_source(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cache = tmp_path / "imports"
    plain = _probe(cache, install=False)
    assert not cache.exists()
    first = _probe(cache, install=True)  # computes and keeps
    kept = sorted(p.name for p in cache.iterdir())
    second = _probe(cache, install=True)  # reads what was kept
    assert {k: first[k] for k in plain} == plain == {k: second[k] for k in plain}
    assert plain["llama"] == "transformers.models.llama.modeling_llama" and "LlamaForCausalLM" in plain["top"]
    assert first["computed"] >= 2 and first["files_read"] > 400, first  # the package and transformers.models
    assert second["computed"] == 0 and second["files_read"] == 0, second
    assert first["equal"] and second["equal"]
    assert len(kept) >= 2 and sorted(p.name for p in cache.iterdir()) == kept  # nothing new the second time


# --- the cache on a small tree of its own, with transformers' own function ------------------------------

@pytest.fixture
def structure() -> Callable[..., Any]:
    """transformers' `define_import_structure` without its lru_caches (each call reads the files)."""
    pytest.importorskip("transformers")
    from transformers.utils import import_utils as iu

    original = getattr(iu.define_import_structure, "__wrapped__", iu.define_import_structure)
    original = getattr(original, "__wrapped__", original)  # under reshard's CLI: reshard's wrapper, then theirs
    original = getattr(original, "__wrapped__", original)

    @functools.wraps(original)  # the same __module__: the same fingerprint
    def fresh(module_path: Any, prefix: str | None = None) -> Any:
        iu.create_import_structure_from_path.cache_clear()
        fresh.calls += 1  # type: ignore[attr-defined]
        return original(module_path, prefix)

    fresh.calls = 0  # type: ignore[attr-defined]
    return fresh


def _tree(root: Path) -> Path:
    pkg = root / "pkg"
    for sub, module, names in (("a", "configuration_a", ["AConfig"]), ("b", "modeling_b", ["BModel", "BPreTrained"])):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
        (pkg / sub / f"{module}.py").write_text(f"__all__ = {json.dumps(names)}\n")
    (pkg / "__init__.py").write_text("")
    return pkg


def _names(result: dict[frozenset[str], dict[str, set[str]]]) -> dict[str, set[str]]:
    return {m: n for modules in result.values() for m, n in modules.items()}


@pytest.mark.pure
def test_a_changed_tree_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, structure: Any) -> None:
    monkeypatch.setenv(importcache.DIR_ENV, str(tmp_path / "cache"))
    pkg = _tree(tmp_path)

    def check(want: dict[str, set[str]], computed: bool) -> None:
        before = structure.calls
        got = importcache.cached(structure, pkg / "__init__.py", "p")  # a file: its folder, as transformers does
        assert _names(got) == want and (structure.calls > before) == computed
        assert got == structure(pkg, "p")  # transformers' own, from the files

    want = {"p.a.configuration_a": {"AConfig"}, "p.b.modeling_b": {"BModel", "BPreTrained"}}
    check(want, computed=True)
    check(want, computed=False)
    assert [p.name.startswith("transformers-") for p in (tmp_path / "cache").iterdir()] == [True]

    (pkg / "a" / "configuration_a.py").write_text('__all__ = ["XConfig"]\n')  # the same size
    check({**want, "p.a.configuration_a": {"XConfig"}}, computed=True)
    want["p.a.configuration_a"] = {"XConfig"}
    (pkg / "b" / "configuration_b.py").write_text('__all__ = ["BConfig"]\n')
    check({**want, "p.b.configuration_b": {"BConfig"}}, computed=True)
    (pkg / "b" / "configuration_b.py").unlink()
    check(want, computed=True)
    check(want, computed=False)

    record = next((tmp_path / "cache").iterdir())
    record.write_text("{not json")
    check(want, computed=True)
    fingerprint, _, body = record.read_text().partition("\n")
    assert len(fingerprint) == 32 and json.loads(body)  # kept again: the fingerprint line, then the JSON


@pytest.mark.pure
def test_a_cache_that_cannot_be_written_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         structure: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(importcache.DIR_ENV, str(blocker / "cache"))  # under a file: mkdir fails
    pkg = _tree(tmp_path)
    for _ in range(2):
        assert importcache.cached(structure, pkg, None) == structure(pkg, None)
    assert structure.calls == 4 and blocker.read_text() == ""


@pytest.mark.pure
def test_any_malformed_record_or_no_home_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   structure: Any) -> None:
    """Records of the right fingerprint but the wrong shape (deeply nested, wrongly typed, empty, not a
    list) and records past the size cap (never parsed) are misses; so is a cache with no home directory."""
    monkeypatch.setenv(importcache.DIR_ENV, str(tmp_path / "cache"))
    pkg = _tree(tmp_path)
    want = structure(pkg, "p")
    assert importcache.cached(structure, pkg, "p") == want
    record = next((tmp_path / "cache").iterdir())
    head = record.read_text().partition("\n")[0] + "\n"
    bodies = ["[" * 100_000, '[[["torch"], {"m": [1, 2]}]]', '[[["torch"], ["m"]]]', "", "{}", "[1]", '[["a", {}]]',
              '[[["torch"], {"m": ["X"]}, 3]]']
    for body in bodies:
        record.write_text(head + body)
        before = structure.calls
        assert importcache.cached(structure, pkg, "p") == want, body[:40]
        assert structure.calls == before + 1, body[:40]  # computed again: a miss
    parsed = []
    monkeypatch.setattr(importcache, "MAX_RECORD", 64)
    monkeypatch.setattr(importcache.json, "loads", lambda *a, **k: parsed.append(a) or json.loads(*a, **k))
    assert importcache.cached(structure, pkg, "p") == want and parsed == []  # larger than the cap: not parsed
    monkeypatch.undo()
    monkeypatch.delenv(importcache.DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert importcache.cached(structure, pkg, "p") == want


@pytest.mark.pure
def test_install_after_transformers_is_imported_does_nothing() -> None:
    pytest.importorskip("transformers")
    import transformers  # noqa: F401

    before = list(sys.meta_path)
    importcache.install()
    assert sys.meta_path == before


EMPTY_PROBE = """
import json
{first}
import reshard
model = reshard.empty_tp_model({{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}})
from transformers.utils import import_utils as iu
print(json.dumps({{"files_read": iu.create_import_structure_from_path.cache_info().misses,
                  "params": sum(p.numel() for p in model.parameters())}}))
"""


def _empty_probe(cache: Path, first: str = "") -> dict[str, Any]:
    env = {**os.environ, importcache.DIR_ENV: str(cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", EMPTY_PROBE.format(first=first)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_empty_tp_model_imports_transformers_through_the_cache_unless_it_was_imported(tmp_path: Path) -> None:
    """A worker that leaves the transformers import to `empty_tp_model` (docs/fill-model.md's) gets the
    cache: the second such process reads no source file; one that imported transformers itself is left alone."""
    pytest.importorskip("transformers")
    own = _empty_probe(tmp_path / "own", first="import transformers")
    assert own["files_read"] > 400 and not (tmp_path / "own").exists()
    first = _empty_probe(tmp_path / "imports")
    second = _empty_probe(tmp_path / "imports")
    assert first["files_read"] > 400 and second["files_read"] == 0, (first, second)
    params = 64 * 16 * 2 + 4 * 16 * 16 + 3 * 16 * 32 + 3 * 16  # embed, head, q/k/v/o, gate/up/down, 3 norms
    assert own["params"] == first["params"] == second["params"] == params

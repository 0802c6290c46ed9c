"""The root of the test suite: the tier check, and the fixtures more than one folder uses.

Tiers (README.md, "Tests"; registered in pyproject's [tool.pytest.ini_options] markers). Every test has
exactly one, set with `pytestmark` per module or a decorator per test where a module mixes tiers:

    pure       in-process only: formats, rules, plans, streams, the app through FastAPI's TestClient
    multiproc  real processes: gloo ranks, torchrun, `python -m reshard.cli ...` runs, mounts
    servers    a real server the test starts: `reshard serve` (uvicorn), moto S3, a static file server
    e2e        the demo, the README and docs pages as a reader runs them, docker compose

A test that needs more than one picks the last that applies in that order (a test that starts a server
and spawns gloo ranks is `servers`). `./run test --fast` runs `pure` alone; `./run test` runs all.

Helpers live in `tests/support/` (imported as `tests.support.X`); the service fixtures below serve the
service and hardening folders, whose conftest.py add their own `server` (one worker; two).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# transformers' import structure (`reshard.importcache`) is kept in a directory of the session's, not in
# the user's cache; subprocesses inherit it (the `reshard` commands, the launcher, the trainer and the gloo
# ranks of tests/support/dist.py switch the cache on, as this process does below)
_IMPORTS = tempfile.TemporaryDirectory(prefix="reshard-imports-")
os.environ.setdefault("RESHARD_IMPORT_CACHE_DIR", _IMPORTS.name)

import pytest  # noqa: E402

import reshard  # noqa: E402

reshard.enable_import_cache()  # `import reshard` alone does not: tests/test_settings.py checks

from reshard.rules import kinds as loaders  # noqa: E402
from reshard.testing.synth import llama_config, make_checkpoint  # noqa: E402
from tests.support.fs import KINDS, TP, Mount, MountError, get_mount  # noqa: E402
from tests.support.live import BIG, SMALL_CKPTS, CuttingProxy, make_ckpt  # noqa: E402
from tests.support.ssl_once import share_tls_context  # noqa: E402

share_tls_context()  # httpx's clients in this process load the CA bundle once, not once each (~30 ms of CPU)

TIERS = ("pure", "multiproc", "servers", "e2e")

# tests/vllm runs in the vLLM environment (`./run test` sets up .venv-vllm and runs it there); without vLLM
# installed the folder is not collected (its conftest points vLLM's paths at a temporary directory)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked, whatever runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"every test needs exactly one tier marker of {', '.join(TIERS)} (see tests/conftest.py); "
            f"tests with none or several ({len(wrong)}):\n" + "\n".join(wrong))


@pytest.fixture(scope="session", autouse=True)
def _verified_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank files verified by `reshard write` and fills are recorded in a directory of the session's
    (`reshard.io.verified`), not in the user's cache; subprocesses inherit it."""
    os.environ.setdefault("RESHARD_VERIFIED_DIR", str(tmp_path_factory.mktemp("verified")))


# --- service fixtures (tests/service, tests/hardening) ------------------------------------------------


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT with the small checkpoints of SMALL_CKPTS and one larger one, `big`."""
    root = tmp_path_factory.mktemp("service") / "root"
    root.mkdir()
    for name, (kw, _) in SMALL_CKPTS.items():
        make_ckpt(root / name, **kw)
    make_ckpt(root / BIG, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1, vocab_size=2048,
              num_attention_heads=8, num_key_value_heads=8)
    return root


@pytest.fixture(scope="session")
def written(ckpt_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`written(name, tp) -> Path` of the directory `reshard write` produced (made once per pair)."""
    from reshard.cli import main

    out_root = tmp_path_factory.mktemp("written")
    made: dict[tuple[str, int], Path] = {}

    def get(name: str, tp: int) -> Path:
        if (name, tp) not in made:
            out = out_root / f"{name}-tp{tp}"
            assert main(["write", str(ckpt_root / name), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 0
            made[(name, tp)] = out
        return made[(name, tp)]

    return get


@pytest.fixture
def ckpt_factory() -> Any:
    return make_ckpt


@pytest.fixture
def cutting_proxy() -> Any:
    return CuttingProxy



@pytest.fixture(autouse=True)
def _registry_unchanged() -> Iterator[None]:
    """Every test leaves the kind registry exactly as it found it."""
    before = dict(loaders._REGISTRY)
    yield
    assert loaders._REGISTRY == before, "a test left the loader registry changed"


# --- output faults (tests/io, tests/trainer): a checkpoint, uninterrupted outputs, small file systems ----


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~6.3 MB float32 Llama-shaped checkpoint: tp=2 rank files of ~3.2 MB each, each starting with its
    1 MiB half of lm_head (so a rank file's data follows its header in a kernel copy, not one buffer)."""
    config = llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=1, vocab_size=2048)
    return make_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", config, seed=3)


@pytest.fixture(scope="session")
def reference(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted outputs on the ordinary disk: `write` (tp=2), `merge` (of those shards)."""
    from reshard.io.sinks.hf_checkpoint import merge
    from reshard.io.sinks.write import write_shards
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    root = tmp_path_factory.mktemp("reference")
    src, manifest = open_source(ckpt)
    write_shards(src, make_plan(src, manifest, TP), root / "write", progress=False)
    merge(root / "write", root / "merge", progress=False)
    return {"write": root / "write", "merge": root / "merge"}


MOUNT_MB = 24


@pytest.fixture(scope="session")
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Mount | str]]:
    """kind -> Mount (a small ext4 and a small tmpfs, unmounted at the end even on failure), or kind -> the
    reason it could not be mounted."""
    base = tmp_path_factory.mktemp("mounts")
    made: dict[str, Mount | str] = {}
    try:
        for kind in KINDS:
            try:
                made[kind] = Mount.create(kind, base / kind, size_mb=MOUNT_MB)
            except MountError as e:
                made[kind] = str(e)
                print(f"\noutput tests on {kind} skip: {e}", file=sys.stderr)
        yield made
    finally:
        for m in made.values():
            if isinstance(m, Mount):
                m.destroy()


@pytest.fixture(params=KINDS)
def fs(request: pytest.FixtureRequest, mounts: dict[str, Mount | str]) -> Iterator[Mount]:
    """Each small file system in turn; left writable, freed and empty afterwards."""
    m = get_mount(mounts, request.param)
    m.clean()
    try:
        yield m
    finally:
        m.clean()

"""Fixtures for the output-fault tests: a small ext4 and a small tmpfs (session-scoped, unmounted at the
end even on failure), a checkpoint of ~5 MB on the ordinary disk, and what an uninterrupted run of
each command writes there (the references every resumed output must equal byte for byte)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.fs import KINDS, TP, Mount, MountError, get_mount

SIZE_MB = 24


@pytest.fixture(scope="session")
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Mount | str]]:
    """kind -> Mount, or kind -> the reason it could not be mounted."""
    base = tmp_path_factory.mktemp("mounts")
    made: dict[str, Mount | str] = {}
    try:
        for kind in KINDS:
            try:
                made[kind] = Mount.create(kind, base / kind, size_mb=SIZE_MB)
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
    from reshard.io.merge import merge
    from reshard.io.sources import open_source
    from reshard.io.writer import write_shards
    from reshard.plan.planner import make_plan

    root = tmp_path_factory.mktemp("reference")
    src, manifest = open_source(ckpt)
    write_shards(src, make_plan(src, manifest, TP), root / "write", progress=False)
    merge(root / "write", root / "merge", progress=False)
    return {"write": root / "write", "merge": root / "merge"}

"""Fixtures for the service tests (helpers in `_live.py`): a session root of small checkpoints, the
`reshard write` output to compare with, and a real `reshard serve` on 127.0.0.1.

Other test directories can reuse them: `from _live import live_server, make_ckpt` with tests/service on
sys.path, or copy the fixtures below. `ckpt_factory`, `server_factory` and `cutting_proxy` hand out
`make_ckpt`, `live_server` and `CuttingProxy` to tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _live import BIG, SMALL_CKPTS, CuttingProxy, LiveServer, live_server, make_ckpt


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


@pytest.fixture(scope="session")
def server(ckpt_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real server on ckpt_root, no token, 256 KiB chunks (small shards still span several)."""
    with live_server(ckpt_root, out=tmp_path_factory.mktemp("out"), log_dir=tmp_path_factory.mktemp("logs"),
                     chunk_size=256 << 10) as srv:
        yield srv
        assert srv.alive(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture
def ckpt_factory() -> Any:
    return make_ckpt


@pytest.fixture
def server_factory() -> Any:
    return live_server


@pytest.fixture
def cutting_proxy() -> Any:
    return CuttingProxy



"""Fixtures of the service tests: a real `reshard serve` (one worker) on the session's `ckpt_root` (the
root conftest.py has it, and `written`, `ckpt_factory`, `cutting_proxy`; helpers in tests/support/live.py).
`server_factory` hands out `live_server` to tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.live import LiveServer, live_server


@pytest.fixture(scope="session")
def server(ckpt_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real server on ckpt_root, no token, 256 KiB chunks (small shards still span several)."""
    with live_server(ckpt_root, out=tmp_path_factory.mktemp("out"), log_dir=tmp_path_factory.mktemp("logs"),
                     chunk_size=256 << 10) as srv:
        yield srv
        assert srv.alive(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture
def server_factory() -> Any:
    return live_server

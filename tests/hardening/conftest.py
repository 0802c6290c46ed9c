"""Fixtures of the hardening tests: `server` and `server_factory` run `reshard serve --workers 2` (as
every server of the hardening suite) on the session's `ckpt_root`; the root conftest.py has it, and
`written`, `ckpt_factory`, `cutting_proxy`. Helpers are in tests/support/hard.py and live.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import hard


@pytest.fixture(scope="session")
def server(ckpt_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The service tests' server, with `--workers 2` (as every server of the hardening suite)."""
    with hard.live_server(ckpt_root, out=tmp_path_factory.mktemp("out"), log_dir=tmp_path_factory.mktemp("logs"),
                          chunk_size=256 << 10) as srv:
        yield srv
        assert srv.alive(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture
def server_factory() -> Any:
    return hard.live_server

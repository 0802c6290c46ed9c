"""Fixtures for the hardening tests: the service tests' fixtures, imported from tests/service/conftest.py
(not copied): ckpt_root, written, ckpt_factory, cutting_proxy; `server` and `server_factory` run
`reshard serve --workers 2`. Helpers are in
`_hard.py`; `_live` (tests/service) is put on sys.path here.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SERVICE_TESTS = Path(__file__).resolve().parents[1] / "service"
if str(SERVICE_TESTS) not in sys.path:
    sys.path.insert(0, str(SERVICE_TESTS))

_spec = importlib.util.spec_from_file_location("_service_test_fixtures", SERVICE_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
import _hard  # noqa: E402  (needs tests/service on sys.path)

ckpt_root = _fixtures.ckpt_root
written = _fixtures.written
ckpt_factory = _fixtures.ckpt_factory
cutting_proxy = _fixtures.cutting_proxy


@pytest.fixture(scope="session")
def server(ckpt_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The service tests' server, with `--workers 2` (as every server of the hardening suite)."""
    with _hard.live_server(ckpt_root, out=tmp_path_factory.mktemp("out"), log_dir=tmp_path_factory.mktemp("logs"),
                           chunk_size=256 << 10) as srv:
        yield srv
        assert srv.alive(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture
def server_factory() -> Any:
    return _hard.live_server

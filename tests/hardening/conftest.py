"""Fixtures for the hardening tests: the service tests' fixtures, imported from tests/service/conftest.py
(not copied): ckpt_root, written, server, ckpt_factory, server_factory, cutting_proxy. Helpers are in
`_hard.py`; `_live` (tests/service) is put on sys.path here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SERVICE_TESTS = Path(__file__).resolve().parents[1] / "service"
if str(SERVICE_TESTS) not in sys.path:
    sys.path.insert(0, str(SERVICE_TESTS))

_spec = importlib.util.spec_from_file_location("_service_test_fixtures", SERVICE_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
ckpt_root = _fixtures.ckpt_root
written = _fixtures.written
server = _fixtures.server
ckpt_factory = _fixtures.ckpt_factory
server_factory = _fixtures.server_factory
cutting_proxy = _fixtures.cutting_proxy

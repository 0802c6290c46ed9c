"""Fixtures for the core tests; the helpers themselves live in `tests/support/core.py`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reshard.rules import kinds as loaders


@pytest.fixture(autouse=True)
def _registry_unchanged() -> Iterator[None]:
    """Every test leaves the kind registry exactly as it found it."""
    before = dict(loaders._REGISTRY)
    yield
    assert loaders._REGISTRY == before, "a test left the loader registry changed"

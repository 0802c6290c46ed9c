"""TP ops and layers on real gloo ranks (world sizes 2 and 4) against the unsharded math.

All checks of one world size run in a single spawned job (see `tests/support/tp_checks.py`); each check is then
reported as its own test with every failing rank's traceback.
"""

from __future__ import annotations

import functools

import pytest

from tests.support.dist import run_distributed
from tests.support.tp_checks import load_checks, run_checks

pytestmark = pytest.mark.multiproc

WORLD_SIZES = (2, 4)


@functools.cache
def _results(world_size: int) -> list[dict[str, str | None]] | BaseException:
    try:
        return run_distributed(run_checks, world_size, timeout=120.0)
    except (AssertionError, RuntimeError) as exc:
        return exc


@pytest.mark.parametrize("name", list(load_checks()))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_check(world_size: int, name: str) -> None:
    results = _results(world_size)
    if isinstance(results, BaseException):
        pytest.fail(f"the tp={world_size} job failed before reporting checks:\n{results}", pytrace=False)
    failed = {rank: per_rank[name] for rank, per_rank in enumerate(results) if per_rank[name] is not None}
    if failed:
        pytest.fail(
            "\n".join(f"--- rank {rank} of {world_size} ---\n{tb}" for rank, tb in failed.items()),
            pytrace=False,
        )

"""The multi-process spawner in tests/support/dist.py: return values, failures with tracebacks, timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed

pytestmark = pytest.mark.multiproc


def _sum_ranks(rank: int, world_size: int, n: int) -> list[float]:
    t = torch.full((n,), float(rank))
    dist.all_reduce(t)
    return [float(rank), *t.tolist()]


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        assert rank == 0, "deliberate failure on rank one"
    dist.barrier()  # rank 0 waits for a peer that never comes


def _raise_value_error(rank: int, world_size: int) -> None:
    raise ValueError(f"bad value on rank {rank}")


def _sleep(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_returns_values_by_rank() -> None:
    assert run_distributed(_sum_ranks, 2, 3, timeout=60) == [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_assertion_on_one_rank_fails_the_test_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    text = str(info.value)
    assert "--- rank 1 (run) ---" in text and "deliberate failure on rank one" in text
    assert "_fail_on_rank_one" in text  # the rank's own traceback
    assert time.monotonic() - start < 30, "the stuck peer was not terminated promptly"


def test_other_exceptions_and_timeout() -> None:
    with pytest.raises(RuntimeError, match="ValueError: bad value on rank 0"):
        run_distributed(_raise_value_error, 1, timeout=60)
    with pytest.raises(RuntimeError, match=r"timed out after 5s; ranks \[0\] did not finish"):
        run_distributed(_sleep, 1, timeout=5)

"""Run a function in real processes joined by a gloo process group, for multi-rank tests.

    from tests.support.dist import run_distributed

    def _check(rank: int, world_size: int, n: int) -> float:   # module level: it is pickled
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        assert t[0] == sum(range(world_size)), t
        return t.sum().item()

    def test_sum():
        assert run_distributed(_check, 2, 3) == [3.0, 3.0]

`run_distributed(fn, world_size, *args)` spawns `world_size` fresh interpreters
(torch.multiprocessing, start method "spawn"), joins them in a gloo process group whose TCP store
listens on a free port of 127.0.0.1, calls `fn(rank, world_size, *args)` in each and returns the
per-rank return values as a list indexed by rank (they must pickle). If any rank raises, the test
gets an AssertionError (when a rank's exception was one) or a RuntimeError, whose message holds
every failing rank's traceback; ranks still running a short grace period later (typically stuck in
a collective their peer never joined) are terminated. The whole run has a timeout.
Each worker uses `threads` intra-op threads (default 1: tests share small machines).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard

__all__ = ["run_distributed"]

reshard.enable_import_cache()  # a spawned rank imports this first: its transformers comes through the session's cache

_GRACE_S = 5.0  # how long other ranks may still finish after one has failed
_PORT_RETRIES = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    threads: int,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    phase = "init"
    try:
        torch.set_num_threads(threads)
        if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
            if any(name == "lo" for _, name in socket.if_nameindex()):
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # single host: stay on loopback
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        phase = "run"
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        phase = "return"
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # report everything, including SystemExit / KeyboardInterrupt
        results.put((rank, False, (phase, isinstance(exc, AssertionError), traceback.format_exc())))


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, backend: str, threads: int
) -> tuple[dict[int, Any], dict[int, tuple[str, bool, str]], list[str]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, backend, timeout, threads, args, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    failures: dict[int, tuple[str, bool, str]] = {}
    problems: list[str] = []
    start = time.monotonic()
    first_failure: float | None = None
    dead_since: dict[int, float] = {}
    try:
        for p in procs:
            p.start()
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if now - start > timeout:
                problems.append(f"timed out after {timeout:.0f}s")
                break
            if first_failure is not None and now - first_failure > _GRACE_S:
                break
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue_mod.Empty:
                for rank, p in enumerate(procs):
                    if rank in values or rank in failures or p.exitcode is None:
                        continue
                    # Exited without a report: allow a moment for a report still in the pipe.
                    if now - dead_since.setdefault(rank, now) > 1.0:
                        failures[rank] = (
                            "crash",
                            False,
                            f"exited with code {p.exitcode} without reporting\n",
                        )
                        first_failure = first_failure or now
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                first_failure = first_failure or time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    missing = [r for r in range(world_size) if r not in values and r not in failures]
    if missing:
        problems.append(f"ranks {missing} did not finish (terminated)")
    return values, failures, problems


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return the values by rank.

    `fn` and `args` must pickle (define `fn` at module level). Raises AssertionError or
    RuntimeError with every failing rank's traceback, or on timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(_PORT_RETRIES):
        values, failures, problems = _run_once(fn, world_size, args, timeout, backend, threads)
        port_taken = any(
            phase == "init" and "address already in use" in text.lower()
            for phase, _, text in failures.values()
        )
        if not (port_taken and attempt + 1 < _PORT_RETRIES):
            break
    if not failures and not problems:
        return [values[r] for r in range(world_size)]
    name = getattr(fn, "__qualname__", repr(fn))
    summary = "; ".join(([f"ranks {sorted(failures)} raised"] if failures else []) + problems)
    lines = [f"run_distributed({name}, world_size={world_size}) failed: {summary}"]
    # Assertion failures first: a peer's "connection closed" error is usually a consequence.
    for rank in sorted(failures, key=lambda r: (not failures[r][1], r)):
        phase, _, text = failures[rank]
        lines.append(f"--- rank {rank} ({phase}) ---\n{text.rstrip()}")
    message = "\n".join(lines)
    if any(is_assert for _, is_assert, _ in failures.values()):
        raise AssertionError(message)
    raise RuntimeError(message)

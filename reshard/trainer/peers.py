"""When one rank of a distributed run fails, every rank stops within seconds with a clean error.

A rank that fails (its `--save` directory is full or read-only, its shard is missing or corrupt)
would otherwise leave its peers waiting in their next collective (the all-gather after saving, the
`new_group` while building) until the process group's timeout, 30 minutes by default. Wrap each
rank's whole run in `stop_peers_on_failure()`:

    with stop_peers_on_failure(prog="reshard.cli.train"):
        train(args)                         # may call init_process_group itself

- A rank whose run raises posts "rank R: <error>" in the default process group's store, waits up to
  `grace_s` for the other ranks to acknowledge it, and re-raises (its caller prints the one line).
- A watcher thread of every rank polls the store. When a peer posted a failure, it prints one line
  (`PROG: error: PeerFailedError: rank 1 failed (...); rank 0 stops too`), acknowledges, waits (at
  most `grace_s`) until the failed rank has reported its own error, and ends the process with status
  1: the main thread may be blocked inside a collective that nothing else can interrupt.

Without a process group (one process), or before one exists, it does nothing. The store is the one
`init_process_group` made (TCPStore clients are safe to share between threads).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import torch.distributed as dist

from reshard.errors import PeerFailedError

_PREFIX = "reshard/peers/"
_COUNT = _PREFIX + "failed"
# how long the other ranks wait once the failed rank has reported: time for it to print its line before a
# launcher that stops every rank when one exits (torchrun) sends it SIGTERM
_AFTER_REPORT_S = 0.5


def _store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class _Watcher(threading.Thread):
    """Polls the store for a peer's failure; exits the process (status 1) with one line when there is one."""

    def __init__(self, prog: str, poll_s: float, grace_s: float) -> None:
        super().__init__(daemon=True, name="reshard-peers")
        self.prog, self.poll_s, self.grace_s = prog, poll_s, grace_s
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # held while this rank posts its own failure
        self.store: dist.Store | None = None

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            try:
                if self.store is None:
                    self.store = _store()
                    continue
                if self.store.add(_COUNT, 0) == 0:
                    continue
                with self.lock:
                    if self.stopped.is_set():
                        return
                    found = self._peer_failure()
            except Exception:  # the store went away (the group is being destroyed): nothing to watch
                return
            if found is not None:
                self._stop_this_rank(*found)

    def _peer_failure(self) -> tuple[int, str] | None:
        assert self.store is not None
        for rank in range(dist.get_world_size()):
            if rank != dist.get_rank() and self.store.check([f"{_PREFIX}failure/{rank}"]):
                return rank, self.store.get(f"{_PREFIX}failure/{rank}").decode(errors="replace")
        return None

    def _stop_this_rank(self, rank: int, failure: str) -> None:
        """Print the line, acknowledge, give the failed rank time to print its own (a launcher such as
        torchrun kills the other ranks as soon as one exits), then exit 1."""
        assert self.store is not None
        me = dist.get_rank()
        print(f"{self.prog}: error: {PeerFailedError.__name__}: rank {rank} failed ({failure}); rank {me} stops too",
              file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}ack/{me}", "1")
            deadline = time.monotonic() + self.grace_s
            while not self.store.check([f"{_PREFIX}reported/{rank}"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(_AFTER_REPORT_S)  # its line follows the key at once
        os._exit(1)


def _post_failure(watcher: _Watcher, exc: BaseException, grace_s: float) -> None:
    """Tell the other ranks this one failed; wait (at most `grace_s`) until each has seen it."""
    with watcher.lock:
        watcher.stopped.set()
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):  # the error itself is what matters; the notice is best effort
        me, world = dist.get_rank(), dist.get_world_size()
        store.set(f"{_PREFIX}failure/{me}", f"{type(exc).__name__}: {exc}"[:2000])
        store.add(_COUNT, 1)
        deadline = time.monotonic() + grace_s
        others = [r for r in range(world) if r != me]
        while others and time.monotonic() < deadline:
            others = [r for r in others if not store.check([f"{_PREFIX}ack/{r}"])
                      and not store.check([f"{_PREFIX}failure/{r}"])]
            time.sleep(0.05)
        store.set(f"{_PREFIX}reported/{me}", "1")  # the caller prints this rank's line right after


@contextlib.contextmanager
def stop_peers_on_failure(*, prog: str = "reshard", poll_s: float = 0.2, grace_s: float = 5.0) -> Iterator[None]:
    """Run the block; if it raises, the other ranks stop too (see the module docstring)."""
    watcher = _Watcher(prog, poll_s, grace_s)
    watcher.start()
    try:
        yield
    except BaseException as e:
        if not isinstance(e, SystemExit) or e.code not in (0, None):
            _post_failure(watcher, e, grace_s)
        raise
    finally:
        watcher.stopped.set()
        watcher.join()


__all__ = ["stop_peers_on_failure"]

"""This server process: its owner id, its death with the supervisor, its signals, its heap and mappings.

Helpers every worker of `reshard serve` uses, whatever started it (one process or `--workers N`);
they know nothing of the app.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reshard.io.mapped import MAPS
from reshard.service.settings import Settings

SUPERVISOR_ENV = "RESHARD_SUPERVISOR_PID"
try:
    _LIBC = ctypes.CDLL(None)
except OSError:  # no C library to load: nothing to trim
    _LIBC = None


_PR_SET_PDEATHSIG = 1


def die_with_supervisor() -> None:
    """Ask the kernel to SIGKILL this worker when its supervisor exits (Linux); a no-op elsewhere."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(supervisor):  # it died before the request above: follow it now
        os.kill(os.getpid(), signal.SIGKILL)


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc `malloc_trim`), called when a worker's last
    open stream ends: chunk buffers come from the heap (fast: no fresh pages per chunk), and the
    server's resident memory returns to its base once its streams are done instead of staying at its
    busiest moment. (A fixed 1 MiB mmap threshold did the same per chunk and cost ~40% of one
    client's throughput; trimming as each of many concurrent streams ended cost ~5% of 16 clients'
    server CPU in page faults.)"""
    with contextlib.suppress(OSError, AttributeError):
        _LIBC.malloc_trim(0)


def enable_mapped_reads(settings: Settings) -> None:
    """Row-split gathers from leased mappings in this server process (long-lived; call from its main thread)."""
    if settings.mapped_reads:
        MAPS.enable()


def stop_on_signals(stop: Callable[[], None]) -> Callable[[], None]:
    """Call `stop` first when SIGTERM or SIGINT arrives, then the handler already installed (uvicorn's
    graceful shutdown); returns a function that puts the previous handlers back. Only the main thread
    may set handlers: elsewhere (an in-process test client) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stopped = False

    def handler(sig: int, frame: Any) -> None:
        # once: a signal landing inside `stop` (Python runs handlers between any two bytecodes) would
        # otherwise call it again while it holds its event's lock, and wait on that lock forever
        nonlocal stopped
        if not stopped:
            stopped = True
            stop()
        prev = previous[sig]
        if callable(prev):
            prev(sig, frame)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, prev in previous.items():
            signal.signal(sig, prev)

    return restore


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if gone or dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie (killed, not yet reaped) is gone too


def this_process() -> str:
    """An owner id for the calling process: `pid:start time`."""
    return f"{os.getpid()}:{_start_time(os.getpid())}"


def is_alive(owner: str) -> bool:
    pid, _, started = owner.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == started

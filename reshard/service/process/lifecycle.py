"""This server process: its owner id, its death with the supervisor, its signals, its heap and mappings.

Owner ids (`reshard.io.owners.this_process()`: pid and start time, so a reused pid is not mistaken for
the process) mark what a worker leaves behind when it is killed: its jobs' rows in the state database,
its temp files (`owner_tag` in the name); `is_alive` (there), `exited` and `pid_gone` (here) tell
whether that owner is gone, so whoever comes next may clean up.

Helpers every worker of `reshard serve` uses, whatever started it (one process or `--workers N`);
they know nothing of the app.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reshard.io.owners import is_alive, start_time
from reshard.io.source.mapped_files import MAPS
from reshard.service.serve_settings import Settings
from reshard.settings import env_name, library_settings

SUPERVISOR_ENV = env_name("supervisor_pid")
try:
    _LIBC = ctypes.CDLL(None)
except OSError:  # no C library to load: nothing to trim
    _LIBC = None


_PR_SET_PDEATHSIG = 1


def die_with_supervisor() -> None:
    """Ask the kernel to SIGKILL this worker when its supervisor exits (Linux); a no-op elsewhere."""
    supervisor = library_settings().supervisor_pid
    if not supervisor:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != supervisor:  # it died before the request above: follow it now
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


# --- owners of files: temp files name the process that writes them (`reshard.io.owners`) -----------

REUSE_MARGIN = 1.0  # seconds: a pid's process that started this long after a file's last write is another one


def _started_epoch(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch (10 ms precision); None if gone or dead."""
    ticks = start_time(pid)
    if ticks is None:
        return None
    since_boot = int(ticks) / os.sysconf("SC_CLK_TCK")  # boot-time based, as CLOCK_BOOTTIME
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def pid_gone(pid: int, *, last_write: float) -> bool:
    """Whether the writer `pid` of a file last written at `last_write` (epoch seconds) is gone: no such
    process runs (a zombie does not), or the one that does started after that write (the pid was reused,
    as it is after a restart in a fresh pid namespace)."""
    started = _started_epoch(pid)
    return started is None or started > last_write + REUSE_MARGIN


def exited(owner: str) -> bool:
    """Whether every thread of `owner` has ended. A SIGKILLed process shows as a zombie (`is_alive` is
    false) as soon as its main thread has ended, while its other threads may still be finishing a
    system call (a write, an open) and hold its files and locks; once this is true none can."""
    if is_alive(owner):
        return False
    pid = owner.partition(":")[0]
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True  # reaped
    for task in tasks:
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            return False
    return True


def wait_exited(owner: str, *, timeout: float) -> bool:
    """Wait (at most `timeout` seconds) until `exited(owner)`; whether it did."""
    deadline = time.monotonic() + timeout
    while not exited(owner):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True

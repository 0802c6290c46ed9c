"""`reshard serve --workers N`: N uvicorn worker processes accepting on one listening socket.

The supervisor (uvicorn's `Multiprocess`, which restarts a worker that dies) binds the socket, hands
every worker the validated settings through `RESHARD_*` environment variables and a fresh
`PROMETHEUS_MULTIPROC_DIR` for the metrics, and on SIGTERM/SIGINT stops the workers gracefully. Each
worker builds the app with `worker_app()`. A worker dies with its supervisor, even a SIGKILLed one
(`PR_SET_PDEATHSIG`), so no orphan keeps the port or a job; jobs it left are marked failed by the next
worker to start (`service.jobs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from service.settings import Settings

SUPERVISOR_ENV = "RESHARD_SUPERVISOR_PID"
try:
    _LIBC = ctypes.CDLL(None)
except OSError:  # no C library to load: nothing to trim
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def settings_env(settings: Settings) -> dict[str, str | None]:
    """`RESHARD_*` variables that rebuild exactly `settings` in another process (None: unset it)."""
    env: dict[str, str | None] = {}
    for name, value in settings.model_dump().items():
        if value is not None and hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"RESHARD_{name.upper()}"] = None if value is None else str(value)
    return env


def _die_with_supervisor() -> None:
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


def worker_app() -> FastAPI:
    """The app of one worker process (uvicorn's factory), settings from the environment."""
    from service.app import create_app

    _die_with_supervisor()
    settings = Settings()
    enable_mapped_reads(settings)
    return create_app(settings)


def enable_mapped_reads(settings: Settings) -> None:
    """Row-split gathers from leased mappings in this server process (long-lived; call from its main thread)."""
    if settings.mapped_reads:
        from reshard.sources.mapped import MAPS

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


def _supervisor_class() -> type:
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        """uvicorn's supervisor, except that SIGTERM/SIGINT reach the workers at once (their handler
        stops write jobs first), not at the supervisor's next half-second look at its signal queue."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._forward)

        def _forward(self, sig: int, frame: Any) -> None:
            self.signal_queue.append(sig)
            for p in self.processes:
                if p.pid is not None and p.exitcode is None:
                    with contextlib.suppress(OSError):
                        os.kill(p.pid, signal.SIGTERM)

    return Supervisor


def http_protocol(settings: Settings) -> str:
    """uvicorn's `http` option: its httptools protocol, with ASGI's zero-copy send unless turned off."""
    return "service.zerocopy:ZeroCopyProtocol" if settings.zero_copy else "httptools"


def serve_workers(settings: Settings, *, workers: int, access_log: bool) -> int:
    """Run `workers` worker processes on one socket until SIGTERM/SIGINT; 3 if the socket cannot be bound."""
    import uvicorn

    from service.metrics import MULTIPROC_ENV

    _Supervisor = _supervisor_class()

    for key, value in settings_env(settings).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ[SUPERVISOR_ENV] = str(os.getpid())
    metrics_dir = tempfile.mkdtemp(prefix="reshard-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    try:
        config = uvicorn.Config("service.workers:worker_app", factory=True, host=settings.host, port=settings.port,
                                workers=workers, log_level=settings.log_level, access_log=access_log,
                                timeout_keep_alive=30, http=http_protocol(settings))
        try:
            sock = config.bind_socket()
        except SystemExit:  # uvicorn has logged why (address in use...)
            return 3
        _Supervisor(config, sockets=[sock]).run()
        return 0
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)

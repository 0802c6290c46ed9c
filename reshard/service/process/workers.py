"""`reshard serve --workers N`: N uvicorn worker processes accepting on one listening socket.

The supervisor (uvicorn's `Multiprocess`, which restarts a worker that dies) binds the socket, hands
every worker the validated settings through `RESHARD_*` environment variables and a fresh
`PROMETHEUS_MULTIPROC_DIR` for the metrics, and on SIGTERM/SIGINT stops the workers gracefully. Each
worker builds the app with `worker_app()`. A worker dies with its supervisor, even a SIGKILLed one
(`PR_SET_PDEATHSIG`), so no orphan keeps the port or a job; jobs it left are marked failed by the next
worker to start (`reshard.service.jobs.runner`).

Every half second the supervisor pings each worker (a thread of the worker answers); one that does not
answer within `--worker-healthcheck-timeout` (30 s; uvicorn's own 5 s killed workers that were only slow
on a machine whose cores were taken by other work) is SIGKILLed as hung. Every worker replaced, killed
that way or dead by itself, is logged at warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from reshard.io.owners import TAG, owner_gone, owner_tag, start_time
from reshard.service.api.app import create_app
from reshard.service.process.lifecycle import SUPERVISOR_ENV, die_with_supervisor, enable_mapped_reads
from reshard.service.prometheus import MULTIPROC_ENV
from reshard.service.serve_settings import Settings

log = logging.getLogger("uvicorn.error")  # the supervisor's lines, at its level and in its format (`WARNING:  ...`)


def settings_env(settings: Settings) -> dict[str, str | None]:
    """`RESHARD_*` variables that rebuild exactly `settings` in another process (None: unset it)."""
    env: dict[str, str | None] = {}
    for name, value in settings.model_dump().items():
        if value is not None and hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"RESHARD_{name.upper()}"] = None if value is None else str(value)
    return env


def worker_app() -> FastAPI:
    """The app of one worker process (uvicorn's factory), settings from the environment."""
    die_with_supervisor()
    settings = Settings()
    enable_mapped_reads(settings)
    return create_app(settings)


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

        def keep_subprocess_alive(self) -> None:
            """uvicorn's (a worker that died, or that did not answer the ping within
            `timeout_worker_healthcheck`, is SIGKILLed and replaced), each replacement logged at warning."""
            before = []
            for p in self.processes:
                # SIGKILLed while a thread of it finished a syscall (an fsync): its main thread is a zombie
                # and it cannot answer; uvicorn's ping would wait the whole healthcheck timeout for it
                gone = p.pid is not None and start_time(p.pid) is None
                if gone:
                    p.is_alive = lambda timeout=5: False
                before.append((p, p.process.is_alive() and not gone))
            super().keep_subprocess_alive()
            for (old, running), now in zip(before, self.processes):
                if now is not old:
                    log.warning(replaced_line(old.pid, old.exitcode, running=running,
                                              timeout=self.config.timeout_worker_healthcheck))

    return Supervisor


def replaced_line(pid: int | None, exitcode: int | None, *, running: bool, timeout: float) -> str:
    """The log line of a worker the supervisor replaced: killed as hung (it ran, and ended by the
    supervisor's SIGKILL), or died on its own (its exit status or signal)."""
    if running and exitcode == -signal.SIGKILL:
        return (f"worker {pid} did not answer the supervisor's healthcheck within {timeout:g} s: killed it "
                f"(SIGKILL) and started another; if the machine is only busy, raise --worker-healthcheck-timeout "
                f"(RESHARD_WORKER_HEALTHCHECK_TIMEOUT)")
    how = f"signal {signal.Signals(-exitcode).name}" if exitcode is not None and exitcode < 0 else f"exit status {exitcode}"
    return f"worker {pid} died ({how}); started another"


def http_protocol(settings: Settings) -> Callable[..., asyncio.Protocol]:
    """uvicorn's `http` option: its httptools protocol with bounded request heads, plus ASGI's
    zero-copy send unless turned off (a partial of a class: it travels to spawned workers as it is)."""
    from reshard.service.transport.protocol import BoundedProtocol, HeadLimits
    from reshard.service.transport.zerocopy import ZeroCopyProtocol

    return functools.partial(ZeroCopyProtocol if settings.zero_copy else BoundedProtocol,
                             limits=HeadLimits.from_settings(settings))


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn `Config` options every `reshard serve` (one process or `--workers N`) shares."""
    return {"host": settings.host, "port": settings.port, "log_level": settings.log_level,
            "timeout_keep_alive": settings.keep_alive_timeout, "http": http_protocol(settings),
            "timeout_worker_healthcheck": settings.worker_healthcheck_timeout}


_METRICS_PREFIX = "reshard-metrics-"


def _metrics_dir() -> str:
    """A fresh directory for prometheus_client's per-worker files, named for this supervisor
    (`reshard-metrics-PID-START-...`); those of supervisors that are gone (SIGKILLed, out of memory: no
    `finally` ran) are removed first."""
    tmp = Path(tempfile.gettempdir())
    for left in tmp.glob(f"{_METRICS_PREFIX}*"):
        m = re.match(rf"{_METRICS_PREFIX}({TAG})-", left.name)
        if m is not None and left.is_dir() and not left.is_symlink() and owner_gone(left, m.group(1), ownerless_age=0):
            shutil.rmtree(left, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_METRICS_PREFIX}{owner_tag()}-")


def serve_workers(settings: Settings, *, workers: int, access_log: bool) -> int:
    """Run `workers` worker processes on one socket until SIGTERM/SIGINT; 3 if the socket cannot be bound."""
    import uvicorn

    _Supervisor = _supervisor_class()

    for key, value in settings_env(settings).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ[SUPERVISOR_ENV] = str(os.getpid())
    metrics_dir = _metrics_dir()
    os.environ[MULTIPROC_ENV] = metrics_dir
    try:
        config = uvicorn.Config("reshard.service.process.workers:worker_app", factory=True, workers=workers,
                                access_log=access_log, **uvicorn_options(settings))
        try:
            sock = config.bind_socket()
        except SystemExit:  # uvicorn has logged why (address in use...)
            return 3
        _Supervisor(config, sockets=[sock]).run()
        return 0
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)

"""Helpers for the hardening tests, on top of `tests.support.live`.

    ThrottledProxy(upstream, rate=...)        a TCP relay that slows responses down (kill a pull halfway)
    live_server(root, ...)                    `live.live_server` with --workers 2 (WORKERS)
    verbose_server(root, token=..., out=...)  `reshard serve` logging everything (trace level, access log)
    metric(srv, prefix), fd_count(pid), rss_anon(pid), tree(path), wait_for(pred), raw_http(srv, head)
    workers(srv)                              the worker processes of a `--workers N` server
    cpu_hog(n)                                `n` processes spinning on the CPU while the block runs
    Created(directory)                        names created in a directory, as they are (inotify)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tests.support import live as _live
from tests.support.live import REPO, LiveServer, LoopbackProxy, _stop, _wait_healthy, free_port, process_tree

WORKERS = 2  # the hardening suite runs against `reshard serve --workers 2`
live_server = functools.partial(_live.live_server, workers=WORKERS)


@contextlib.contextmanager
def verbose_server(root: Path, *, token: str, out: Path, log_path: Path) -> Iterator[LiveServer]:
    """Like `live.live_server`, but with uvicorn's most verbose logging (every request, every ASGI
    message) and the token from the environment, as a deployment would pass a secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_") or k == "RESHARD_VERIFIED_DIR"}
    env.update(RESHARD_TOKEN=token, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    port = free_port()
    cmd = [sys.executable, "-m", "reshard.cli", "serve", "--root", str(root), "--host", "127.0.0.1",
           "--port", str(port), "--out", str(out), "--log-level", "trace", "--workers", str(WORKERS)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    srv = LiveServer(f"http://127.0.0.1:{port}", proc, log_path, token)
    try:
        assert _wait_healthy(srv, 60, WORKERS), srv.log()
        yield srv
    finally:
        _stop(proc)


def workers(srv: LiveServer) -> list[int]:
    """The worker processes of a `--workers N` server (not the supervisor, not multiprocessing's tracker)."""
    out = []
    for pid in process_tree(srv.proc.pid)[1:]:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


@contextlib.contextmanager
def cpu_hog(n: int = 2) -> Iterator[list[int]]:
    """`n` processes spinning on the CPU until the block ends (a machine whose cores other jobs take);
    their pids. Each is checked to be running when the block starts."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        assert wait_for(lambda: all(_cpu_ticks(p.pid) > 0 for p in procs), timeout=30), "the hog did not start"
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of `pid` so far, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def metric(srv: LiveServer, prefix: str) -> float:
    """The sum of the /metrics samples whose line starts with `prefix`."""
    text = httpx.get(srv.url + "/metrics", headers=srv.headers(), timeout=30).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))


def fd_count(pid: int) -> int:
    """Open file descriptors of a process and its descendants (a server's workers)."""
    return sum(len(os.listdir(f"/proc/{p}/fd")) for p in process_tree(pid) if os.path.isdir(f"/proc/{p}/fd"))


def rss_anon(pid: int) -> int:
    """Anonymous resident memory (heap, stacks; not the page cache of mapped files) of a process and its
    descendants, in bytes."""
    return _live.tree_status_kib(pid, "RssAnon") * 1024


def tree(path: Path) -> dict[str, int]:
    """Every file under `path` (relative name -> size), hidden ones included."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            p = Path(dirpath) / f
            with contextlib.suppress(FileNotFoundError):
                out[str(p.relative_to(path))] = p.lstat().st_size
    return out


def wait_for(pred: Callable[[], object], timeout: float = 20.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def raw_http(srv: LiveServer, head: str, body: bytes = b"", *, timeout: float = 10.0) -> tuple[int, bytes]:
    """Send a hand-written request (`head` without the final blank line); (status, whole answer)."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head.encode("latin-1") + b"\r\nConnection: close\r\n\r\n" + body)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return int(got.split(b" ", 2)[1]), got


class ThrottledProxy(LoopbackProxy):
    """A TCP relay to `upstream` that sends responses at about `rate` bytes/s (requests pass freely).
    `rcvbuf` caps its receive window towards the server, so the server cannot run far ahead."""

    def __init__(self, upstream: tuple[str, int], *, rate: float, rcvbuf: int | None = None) -> None:
        self.rate, self.rcvbuf = rate, rcvbuf
        super().__init__(upstream)

    def _connect_upstream(self) -> socket.socket:
        up = socket.socket()
        if self.rcvbuf:
            up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        up.connect(self.upstream)
        return up

    def _relay(self, up: socket.socket, client: socket.socket, state: object) -> None:
        while data := up.recv(32768):
            client.sendall(data)
            time.sleep(len(data) / self.rate)


class Created:
    """The names created in `directory` from now on, the moment each is (Linux inotify, IN_CREATE), so
    a test can act on a file before its writer writes to it (SIGKILL the writer of a temp file)."""

    _IN_CREATE = 0x100

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or self._libc.inotify_add_watch(self.fd, os.fsencode(directory), self._IN_CREATE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {directory}")
        self._pending: list[str] = []

    def next(self, timeout: float) -> str | None:
        """The next name created (None after `timeout` seconds without one)."""
        deadline = time.monotonic() + timeout
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            data = os.read(self.fd, 65536)
            while data:
                _wd, _mask, _cookie, n = struct.unpack_from("iIII", data)
                self._pending.append(data[16 : 16 + n].rstrip(b"\0").decode())
                data = data[16 + n :]
        return self._pending.pop(0)

    def wait_for(self, pred: Callable[[str], bool], timeout: float) -> str | None:
        """The first name created that `pred` accepts, within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (name := self.next(deadline - time.monotonic())) is not None:
            if pred(name):
                return name
        return None

    def __enter__(self) -> Created:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

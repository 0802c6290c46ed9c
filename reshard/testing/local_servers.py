"""Local servers on 127.0.0.1 for tests and benchmarks: a moto S3 server and a static Range file server,
each counting the body bytes it serves, and the one way to start a server process and wait for it.

    with s3_server() as s3:                     # moto in server mode on 127.0.0.1:free port
        s3.env                                  # AWS_* variables pointing a client at it
        s3.counts()                             # {"bytes": N, "requests": N} served so far
        s3.reset()
    with http_server(root) as web:              # reshard.testing.fileserver (Starlette FileResponse: Range, ETag)
        web.url + "/files/NAME/"                # a checkpoint directory over plain HTTP
    with server(argv, ready_url) as proc: ...   # any server: started, waited for, stopped by its own pid

Each store is a subprocess (`python -m reshard.testing.local_servers s3|http --port P [--root DIR]`); the
counts come from a WSGI/ASGI wrapper around the real server, at `GET /_reshard_counts` (bucket names cannot
start with `_`, so the path never reaches moto), reset by `DELETE` on the same path. moto (the `test` and
`bench` extras) is imported only in the S3 server's process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]  # the directory holding the reshard package
COUNTS_PATH = "/_reshard_counts"
# moto accepts any key unless authentication is enabled; these only have to look like credentials
TEST_KEY_ID, TEST_SECRET = "AKIARESHARDTEST00001", "reshard-test-secret-key-000000000000000"


class _Counter:
    def __init__(self, fail_every: int = 0, one_range: bool = False) -> None:
        self.lock = threading.Lock()
        self.bytes = self.requests = self.failed = 0
        self.fail_every, self.one_range = fail_every, one_range

    def start(self) -> bool:
        """Count a request; True if it is to be answered 503 (every `fail_every`-th: a flaky server)."""
        with self.lock:
            self.requests += 1
            fail = bool(self.fail_every) and self.requests % self.fail_every == 0
            self.failed += fail
            return fail

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n

    def answer(self, method: str) -> bytes:
        with self.lock:
            body = json.dumps({"bytes": self.bytes, "requests": self.requests, "failed": self.failed}).encode()
            if method == "DELETE":
                self.bytes = self.requests = self.failed = 0
        return body


def counting_wsgi(app: Any, counter: _Counter) -> Any:
    def wrapped(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            start_response("200 OK", [("Content-Type", "application/json")])
            return [counter.answer(environ["REQUEST_METHOD"])]
        counter.start()
        return _counted(app(environ, start_response), counter)
    return wrapped


def _counted(body: Any, counter: _Counter) -> Iterator[bytes]:
    try:
        for chunk in body:
            counter.add(len(chunk))
            yield chunk
    finally:
        if hasattr(body, "close"):
            body.close()


def counting_asgi(app: Any, counter: _Counter) -> Any:
    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == COUNTS_PATH:
            body = counter.answer(scope["method"])
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http" and counter.start():
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["type"] == "http" and counter.one_range:  # as servers that answer several ranges with the whole file
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if not (k == b"range" and b"," in v)]}

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                counter.add(len(message.get("body", b"")))
            await send(message)

        await app(scope, receive, counted)
    return wrapped


def _serve_s3(port: int) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = counting_wsgi(DomainDispatcherApplication(create_backend_app), _Counter())
    make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler).serve_forever()


def _serve_http(port: int, root: str, fail_every: int, one_range: bool) -> None:
    import uvicorn

    from reshard.testing.fileserver import file_app

    uvicorn.run(counting_asgi(file_app(root), _Counter(fail_every, one_range)), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except urllib.error.HTTPError as e:
            if e.code < 500:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server did not answer {url} within {timeout:.0f} s")


@contextlib.contextmanager
def server(argv: Sequence[str], ready_url: str, *, env: dict[str, str] | None = None,
           log: Path | None = None, timeout: float = 60.0) -> Iterator[subprocess.Popen[bytes]]:
    """Start `argv`, wait until `ready_url` answers, yield the process; stop it afterwards."""
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(list(argv), env={**os.environ, **(env or {})}, cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_ready(ready_url, proc, timeout)
        except RuntimeError as e:
            tail = log.read_text(errors="replace")[-1500:] if log and log.exists() else ""
            raise RuntimeError(f"{e}: {' '.join(argv)}\n{tail}") from None
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if argv[0] != "nginx" and not argv[0].endswith("/nginx") else signal.SIGQUIT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log:
            out.close()


@dataclass
class StoreServer:
    """A running server: `url`, its process, and (for S3) the environment a client needs."""

    url: str
    proc: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return httpx.get(self.url + COUNTS_PATH, timeout=10).json()

    def reset(self) -> dict[str, int]:
        return httpx.delete(self.url + COUNTS_PATH, timeout=10).json()


def s3_env(endpoint: str, *, key_id: str = TEST_KEY_ID, secret: str = TEST_SECRET) -> dict[str, str]:
    """AWS variables for a client of the local S3 server (plain HTTP allowed, path-style requests)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


@contextlib.contextmanager
def _spawn(args: list[str], env: dict[str, str] | None = None, timeout: float = 60.0) -> Iterator[StoreServer]:
    port = free_port()
    full_env = {**(env or {}), "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="reshard-store-") as d, \
            server([sys.executable, "-m", "reshard.testing.local_servers", *args, "--port", str(port)], url + COUNTS_PATH,
                   env=full_env, log=Path(d) / "server.log", timeout=timeout) as proc:
        yield StoreServer(url, proc)


@contextlib.contextmanager
def s3_server(*, authenticate: bool = False) -> Iterator[StoreServer]:
    """moto's S3 in server mode; with `authenticate`, every request must be signed by a key moto's
    IAM knows (none are created, so every key is wrong: for credential-error tests)."""
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if authenticate else {"INITIAL_NO_AUTH_ACTION_COUNT": "inf"}
    with _spawn(["s3"], env) as srv:
        srv.env = s3_env(srv.url)
        yield srv


@contextlib.contextmanager
def http_server(root: Path, *, fail_every: int = 0, one_range: bool = False) -> Iterator[StoreServer]:
    """`reshard.testing.fileserver` over `root`: GET /files/PATH with Range (one range or several: a
    multipart/byteranges answer), ETag and Last-Modified; with `fail_every`, every N-th request is
    answered 503 instead; with `one_range`, a request for several ranges gets the whole file (200)."""
    with _spawn(["http", "--root", str(root), "--fail-every", str(fail_every), *(["--one-range"] if one_range else [])]) as srv:
        yield srv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m reshard.testing.local_servers")
    p.add_argument("kind", choices=["s3", "http"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--root", default=".")
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--one-range", action="store_true")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.kind == "s3":
        _serve_s3(args.port)
    else:
        _serve_http(args.port, args.root, args.fail_every, args.one_range)


if __name__ == "__main__":
    main()

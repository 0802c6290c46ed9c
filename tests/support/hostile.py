"""A hostile stand-in for `reshard serve`: a real HTTP server on 127.0.0.1 that answers the client's routes
from real rank files, and lies as a test tells it to.

    with HostileServer(shards={(0, 2): bytes, (1, 2): bytes}, config={...}, meta={"config.json": b"..."}) as srv:
        srv.url                        # http://127.0.0.1:PORT/v1/checkpoints/ck
        srv.body[(0, 2)] = other       # serve other bytes for rank 0 of tp=2 (the ETag and digest follow them
        srv.digest[(0, 2)] = "0" * 64  #   unless set here: a lie about the digest)
        srv.listing = [...]            # the `files` of GET .../meta, as given
        srv.meta_body["config.json"] = endless   # a callable yielding chunks forever, or bytes
        srv.trickle = 5.0              # shard bodies: one byte every 5 s
        srv.extra_length = 1000        # shard bodies: Content-Length claims 1000 bytes more, then the server waits
        srv.send_sha = False           # no x-reshard-sha256 header: the client asks .../digest
        srv.requests                   # (method, path with query, headers) of every request, in order
        srv.boxes_source = ckpt_dir    # POST .../boxes answered with what reshard plans from it (PlannedBody);
        srv.boxes_edit = fn            #   fn(bytes) -> the bytes sent, under the digest of the true ones
        srv.boxes_digest = "0" * 64    #   or a digest of zeros (None: the true one)

Threads of `http.server` (HTTP/1.1, keep-alive); every wait ends when the server stops.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

NAME = "ck"
Body = bytes | Callable[[], Iterator[bytes]]
_SHARD = re.compile(rf"^/v1/checkpoints/{NAME}/shards/(\d+)(/digest)?$")
_META = re.compile(rf"^/v1/checkpoints/{NAME}/meta(?:/(.+))?$")


def endless(chunk: int = 1 << 16) -> Callable[[], Iterator[bytes]]:
    """A body that never ends (`chunk` bytes at a time)."""
    def gen() -> Iterator[bytes]:
        while True:
            yield b"x" * chunk
    return gen


class HostileServer:
    def __init__(self, *, shards: dict[tuple[int, int], bytes], config: dict[str, Any],
                 meta: dict[str, bytes] | None = None) -> None:
        self.body: dict[tuple[int, int], bytes] = dict(shards)
        self.digest: dict[tuple[int, int], str] = {}
        self.config = config
        self.meta_body: dict[str, Body] = dict(meta or {})
        self.listing: list[Any] | None = None
        self.trickle = 0.0
        self.extra_length = 0
        self.send_sha = True
        self.boxes_source: Any = None
        self.boxes_edit: Callable[[bytes], bytes] | None = None
        self.boxes_digest: str | None = None
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.stopping = threading.Event()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def url(self) -> str:
        return f"{self.origin}/v1/checkpoints/{NAME}"

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self._http.shutdown()
        self._http.server_close()

    def sha(self, key: tuple[int, int]) -> str:
        return self.digest.get(key) or hashlib.sha256(self.body[key]).hexdigest()

    def etag(self, key: tuple[int, int]) -> str:
        return '"' + hashlib.sha256(self.body[key]).hexdigest()[:16] + '"'

    def meta_listing(self) -> list[Any]:
        if self.listing is not None:
            return self.listing
        return [{"name": n, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                for n, b in self.meta_body.items() if isinstance(b, bytes)]


def _handler(srv: HostileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            srv.requests.append(("GET", self.path, dict(self.headers.items())))
            u = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(u.query).items()}
            if u.path == f"/v1/checkpoints/{NAME}":
                return self._json(200, {"name": NAME, "config": srv.config})
            if m := _META.match(u.path):
                if m.group(1) is None:
                    return self._json(200, {"name": NAME, "files": srv.meta_listing()})
                body = srv.meta_body.get(m.group(1))
                if body is None:
                    return self._json(404, {"error": "NotFoundError", "detail": f"no {m.group(1)}"})
                return self._bytes(body) if isinstance(body, bytes) else self._endless(body)
            if (m := _SHARD.match(u.path)) and (int(m.group(1)), int(query.get("tp", 1))) in srv.body:
                key = (int(m.group(1)), int(query.get("tp", 1)))
                if m.group(2):
                    return self._json(200, {"sha256": srv.sha(key), "size": len(srv.body[key]), "etag": srv.etag(key)})
                return self._shard(key)
            return self._json(404, {"error": "NotFoundError", "detail": f"no {u.path}"})

        def do_POST(self) -> None:  # noqa: N802
            from reshard.format.box_request import Box
            from reshard.io.client.box_client import PlannedBody

            srv.requests.append(("POST", self.path, dict(self.headers.items())))
            payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if urlsplit(self.path).path != f"/v1/checkpoints/{NAME}/boxes" or srv.boxes_source is None:
                return self._json(404, {"error": "NotFoundError", "detail": f"no {self.path}"})
            body = PlannedBody(srv.boxes_source, [Box(**b) for b in payload["boxes"]])
            data = bytearray(body.size)
            body.readinto(memoryview(data))
            body.close()
            sent = srv.boxes_edit(bytes(data)) if srv.boxes_edit else bytes(data)
            self.send_response(200)
            self.send_header("ETag", '"' + hashlib.sha256(sent).hexdigest()[:16] + '"')
            self.send_header("x-reshard-sha256", srv.boxes_digest or hashlib.sha256(data).hexdigest())
            self.send_header("Content-Length", str(len(sent)))
            self.end_headers()
            self.wfile.write(sent)

        def _json(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _bytes(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _endless(self, gen: Callable[[], Iterator[bytes]]) -> None:
            self.send_response(200)
            self.send_header("Connection", "close")  # the body ends when the connection does: never
            self.end_headers()
            self.close_connection = True
            try:
                for piece in gen():
                    if srv.stopping.is_set():
                        return
                    self.wfile.write(piece)
            except OSError:  # the client hung up
                pass

        def _shard(self, key: tuple[int, int]) -> None:
            data = srv.body[key]
            lo, status = 0, 200
            m = re.match(r"^bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
            if m:
                lo, status = int(m.group(1)), 206
                hi = int(m.group(2)) + 1 if m.group(2) else len(data)
                part = data[lo:hi]
            else:
                part = data
            self.send_response(status)
            self.send_header("ETag", srv.etag(key))
            if srv.send_sha:
                self.send_header("x-reshard-sha256", srv.sha(key))
            if status == 206:
                self.send_header("Content-Range", f"bytes {lo}-{lo + len(part) - 1}/{len(data)}")
            lie = srv.extra_length if len(part) > 1 else 0
            self.send_header("Content-Length", str(len(part) + lie))
            self.end_headers()
            try:
                if srv.trickle and len(part) > 1:
                    for i in range(len(part)):
                        self.wfile.write(part[i : i + 1])
                        self.wfile.flush()
                        if srv.stopping.wait(srv.trickle):
                            return
                    return
                self.wfile.write(part)
                if lie:
                    srv.stopping.wait()  # the bytes it promised never come
                    self.close_connection = True
            except OSError:
                pass

    return Handler


__all__ = ["NAME", "HostileServer", "endless"]

"""A rank file's bytes read straight into the caller's memory: from a local rank file, or from the service.

    body = file_body(path, sha256=recorded)       # a rank file on disk (preadv into the caller's buffers)
    body = ShardBody(checkpoint_url, rank, tp)    # one shard from `reshard serve` (recv_into them)
    body.readinto(memoryview_of_a_parameter)      # exactly len(view) bytes, in order, or an error
    body.expected_sha256()                        # after the last byte: what they must hash to (None: unknown)

No intermediate buffer: the kernel copies the bytes from the page cache or the socket into the view
the caller gives (`reshard.fill.into_params` gives each parameter's own storage). `ShardBody` speaks
HTTP/1.1 through the standard library's `http.client`, whose `readinto` goes down to `recv_into` for
large views (httpx hands out 64 KiB pieces through its parser: at 537 MB per rank that parsing and
the copy out of those pieces took 2-3 s of a 6 s fill). A broken connection is resumed like
`ShardClient` resumes a pull (`Range: bytes=POS-`, `If-Range: ETAG`; a shard that changed meanwhile
is an `IntegrityError`); an error answer is raised as `ShardClient` raises it (the server's JSON
error named), by asking for it again through the client. Both kinds are also iterable in chunks, for
consumers that take chunks. Why `ShardBody` is not on httpx like `ShardClient` (import cost, bytes per
second, measured) is in `reshard.io.client.shard_client`'s docstring.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlencode

from reshard.errors import IntegrityError, ReshardError, SourceChangedError
from reshard.io.client.pace import Pace
from reshard.io.client.wire import (
    MAX_JSON_BYTES,
    RETRY_CAP,
    SHA_HEADER,
    as_world,
    auth_headers,
    checkpoint_url,
    connect,
    layout_params,
    without_credentials,
)
from reshard.io.pread import pread_full
from reshard.io.retry import Backoff, Retries, Retryable, announce
from reshard.layout.mesh import Layout

if TYPE_CHECKING:
    from reshard.io.client.shard_client import ShardClient

CHUNK = 8 << 20  # bytes per chunk when the body is iterated


class RankBytes(Protocol):
    """The bytes of one rank file, read in order."""

    name: str
    size: int
    verify: bool  # whether there is a digest to check the bytes against

    def readinto(self, view: memoryview) -> None:
        """The next len(view) bytes into `view`; an `IntegrityError` where the body ends first."""

    def expected_sha256(self) -> str | None:
        """After the last byte: the sha256 the bytes must have (None: nothing to check against)."""

    def close(self) -> None: ...


def chunks_of(body: RankBytes, *, chunk: int = CHUNK) -> Iterator[bytes]:
    """The rest of `body` in chunks of at most `chunk` bytes (each its own memory)."""
    left = body.size - body.pos  # type: ignore[attr-defined]
    while left > 0:
        buf = bytearray(min(chunk, left))
        body.readinto(memoryview(buf))
        left -= len(buf)
        yield bytes(buf)


class FileBody:
    """A rank file on disk; `sha256` is what `reshard.json` recorded for it (None: not recorded)."""

    def __init__(self, path: Path, sha256: str | None = None) -> None:
        self.name, self.sha256, self.pos, self.verify = str(path), sha256, 0, sha256 is not None
        self.verified_as: str | None = None  # how the bytes were verified already (a prefetch), if they were
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def readinto(self, view: memoryview) -> None:
        got = pread_full(self.fd, view, self.pos)
        if got < len(view):
            raise IntegrityError(f"{self.name}: ended at byte {self.pos + got}, inside its data; "
                                 "the file is truncated: write it again")
        self.pos += got

    def expected_sha256(self) -> str | None:
        return self.sha256

    def seek(self, pos: int) -> None:
        """Read on from byte `pos` (a fill skips the tensors it mapped)."""
        self.pos = pos

    def __iter__(self) -> Iterator[bytes]:
        return chunks_of(self)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


_RETRY_ON = (Retryable, OSError, http.client.HTTPException)


class ShardBody:
    """`GET .../shards/RANK?tp=TP` of the service, received into the caller's buffers (see the module)."""

    def __init__(self, url: str, rank: int, tp: int | Layout, *, token: str | None = None, timeout: float = 60.0,
                 retries: int = 5, backoff: float = 0.25, rules: str | None = None, engine: str | None = None) -> None:
        self.url, self._basic = without_credentials(checkpoint_url(url))  # no password in any name or message
        self.rank, self.tp = rank, tp
        self.params = {k: v for k, v in (("rules", rules), ("engine", engine)) if v}
        self._shard = f"{self.url}/shards/{rank}"
        self._query = {**self.params, **layout_params(tp)}
        self._client: ShardClient | None = None  # httpx, only to name an error answer
        self._start(f"{self.url} rank {rank}/{as_world(tp)}", token=token, timeout=timeout, retries=retries,
                    backoff=backoff)

    def _start(self, name: str, *, token: str | None, timeout: float, retries: int, backoff: float) -> None:
        """Set what every body of the service has, then send the request (`_send`) and check its answer."""
        self.name, self.token, self.timeout, self.retries, self.backoff = name, token, timeout, retries, backoff
        self._auth = {**auth_headers(token), **self._basic}  # a URL's credentials: see `without_credentials`
        self._pace = Pace.from_settings()
        self.pos, self.size, self.etag, self.sha256, self.verify = 0, 0, "", None, True
        self._conn: http.client.HTTPConnection | None = None
        self._resp: http.client.HTTPResponse | None = None
        # failures in a row: a byte received resets the count (`_recv`), across `readinto` calls
        self._tries = Retries(Backoff(retries, backoff, RETRY_CAP), give_up=lambda e: ReshardError(
            f"{self.name}: giving up after {self.retries} retries at byte {self.pos}: {e or type(e).__name__}"),
            on_retry=announce(self.name, retries))
        try:
            self._call(self._open)
        except BaseException:
            self.close()
            raise

    def _send(self, headers: dict[str, str]) -> http.client.HTTPConnection:
        """Send the request (with `headers`) on a new connection: `GET` of the shard."""
        conn, target = connect(self._shard + "?" + urlencode(self._query), timeout=self.timeout)
        self._conn = conn
        conn.request("GET", target, headers=headers)
        return conn

    def _refused(self, resp: http.client.HTTPResponse) -> None:
        """Raise the error a 4xx answer names: asked again through the httpx client, as `ShardClient` raises it."""
        self._disconnect()
        self.client().head(self.rank, self.tp)

    def _open(self) -> int:
        """(Re)send the request from `self.pos`; check what answers it."""
        self._disconnect()
        headers = {**self._auth, "Accept-Encoding": "identity"}
        if self.pos:
            headers.update({"Range": f"bytes={self.pos}-", "If-Range": self.etag})
        self._pace.restart()
        conn = self._send(headers)
        resp = conn.getresponse()
        self._resp = resp
        if resp.status >= 500:
            raise Retryable(f"HTTP {resp.status}")
        if resp.status >= 400:
            self._refused(resp)
            raise Retryable(f"HTTP {resp.status}")
        self._check(resp)
        if conn.sock is not None:  # the body: no byte for `stall` seconds is a stall
            conn.sock.settimeout(self._pace.limits.read_timeout(self.timeout))
        resp.fp = _EachReceive(resp.fp)  # type: ignore[assignment]
        return 0

    def _check(self, resp: http.client.HTTPResponse) -> None:
        etag, length = resp.getheader("etag") or "", int(resp.getheader("content-length") or -1)
        if length < 0:  # the service always sends one: the head was cut short
            raise Retryable(f"HTTP {resp.status} without a Content-Length")
        if self.pos == 0:
            if resp.status != 200:
                raise ReshardError(f"{self.name}: unexpected HTTP {resp.status} to a request without Range")
            self.size, self.etag = length, etag
        elif resp.status != 206 or etag != self.etag:
            raise IntegrityError(f"{self.name}: the shard changed on the server (ETag {self.etag} -> {etag}); "
                                 "the bytes received so far are stale: fill again")
        elif resp.getheader("content-range", "") != f"bytes {self.pos}-{self.size - 1}/{self.size}":
            raise IntegrityError(f"{self.name}: asked for bytes {self.pos}-, got Content-Range "
                                 f"{resp.getheader('content-range')!r}")
        self.sha256 = resp.getheader(SHA_HEADER) or self.sha256

    def readinto(self, view: memoryview) -> None:
        if self.pos + len(view) > self.size:
            raise IntegrityError(f"{self.name}: {self.size} bytes in the shard, asked for bytes up to "
                                 f"{self.pos + len(view)}")
        got = 0
        while got < len(view):
            n = self._call(self._recv, view[got:])
            got += n
            self.pos += n

    def _recv(self, view: memoryview) -> int:
        if self._resp is None:
            self._open()
        assert self._resp is not None
        n = self._resp.readinto(view)
        if not n:
            raise Retryable(f"connection closed at byte {self.pos} of {self.size}")
        if self._pace.got(n):  # a trickle is no progress: it raises `Stalled` instead
            self._tries.progressed()
        return n

    def _call(self, do: Callable[..., int], *args: Any) -> int:
        """`do(*args)`, tried again on a fresh connection after a broken one, a timeout or a 5xx."""
        while True:
            try:
                return do(*args)
            except _RETRY_ON as e:
                self._disconnect()
                self._tries.failed(e)

    def expected_sha256(self) -> str | None:
        if self.sha256 is None:  # the server did not know it when the body started: it does now
            d = get_json(self._shard + "/digest", params=self._query, token=self.token, timeout=max(self.timeout, 600.0),
                         credentials=self._basic)
            if d["etag"] != self.etag:
                raise IntegrityError(f"{self.name}: the shard changed on the server during the download")
            self.sha256 = d["sha256"]
        return self.sha256

    def __iter__(self) -> Iterator[bytes]:
        return chunks_of(self)

    def _disconnect(self) -> None:
        resp, conn, self._resp, self._conn = self._resp, self._conn, None, None
        for part in (resp, conn):
            if part is not None:
                with contextlib.suppress(OSError):
                    part.close()

    def client(self) -> ShardClient:
        """The httpx client for the same checkpoint (made on first use)."""
        if self._client is None:
            from reshard.io.client.shard_client import ShardClient

            self._client = ShardClient(self.url, credentials=self._basic, token=self.token, retries=self.retries, timeout=self.timeout,
                                       backoff=self.backoff, **self.params)
        return self._client

    def close(self) -> None:
        self._disconnect()
        if getattr(self, "_client", None) is not None:
            self._client.close()


def get_json(url: str, *, params: dict[str, Any] | None = None, token: str | None = None,
             timeout: float = 60.0, credentials: dict[str, str] | None = None) -> dict[str, Any]:
    """GET a small JSON answer of the service (the checkpoint's info, a shard's digest) with `http.client`;
    anything but a 2xx answer is asked again through `ShardClient`, which retries and raises the error
    the server named, so both paths fail alike."""
    clean, basic = without_credentials(url)
    basic = basic or credentials or {}
    full = clean + ("?" + urlencode(params) if params else "")
    try:
        conn, target = connect(full, timeout=timeout)
        try:
            conn.request("GET", target, headers={**auth_headers(token), **basic, "Accept-Encoding": "identity"})
            pace = Pace.from_settings()
            resp = conn.getresponse()
            if 200 <= resp.status < 300:
                return json.loads(read_capped(resp, cap=MAX_JSON_BYTES, pace=pace, what=clean))
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ValueError, ReshardError, Retryable):
        pass  # asked again through the client, which retries and names the error
    return _through_client(clean, params or {}, token, timeout, basic)


def read_capped(resp: http.client.HTTPResponse, *, cap: int, pace: Pace, what: str) -> bytes:
    """The body of `resp`, at most `cap` bytes (more, or a Content-Length above it, is an `IntegrityError`),
    read at `pace`."""
    length = resp.getheader("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise IntegrityError(f"{what}: the answer is {length} bytes, over the {cap} a client takes")
    parts, n = [], 0
    while piece := resp.read1(1 << 16):
        n += len(piece)
        if n > cap:
            raise IntegrityError(f"{what}: the answer runs past the {cap} bytes a client takes")
        pace.got(len(piece))
        parts.append(piece)
    return b"".join(parts)


def _through_client(url: str, params: dict[str, Any], token: str | None, timeout: float,
                    credentials: dict[str, str]) -> dict[str, Any]:
    from reshard.io.client.shard_client import ShardClient  # httpx only on this path

    base = url[: url.index("/v1/checkpoints/")] + "/v1/checkpoints/" + url.split("/v1/checkpoints/", 1)[1].split("/")[0]
    with ShardClient(base, token=token, timeout=timeout, credentials=credentials) as client:
        return client._json("GET", url, params=params)  # noqa: SLF001  the same request, retried, errors named


class _EachReceive:
    """A response's socket file whose `readinto` returns what one receive brought (`readinto1`), not only
    once the view is full: then each receive is counted by the body's pace (a server sending a byte every
    few seconds would otherwise fill a 16 MiB view without any timeout firing). Still straight into the
    caller's memory; everything else is the file's own."""

    def __init__(self, fp: Any) -> None:
        self._fp = fp

    def readinto(self, b: memoryview) -> int:
        return self._fp.readinto1(b)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)


def file_body(path: Path, *, sha256: str | None = None) -> FileBody:
    try:
        return FileBody(path, sha256)
    except OSError as e:
        raise SourceChangedError(f"{path}: cannot open: {e.strerror}") from None


__all__ = ["FileBody", "RankBytes", "ShardBody", "chunks_of", "file_body", "get_json", "read_capped"]

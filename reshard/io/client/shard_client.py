"""Pull a rank shard from `reshard serve`: retries, resume with `Range`, length and sha256 verified.

    client = ShardClient("http://host:8000/v1/checkpoints/llama")   # token: argument or RESHARD_TOKEN
    client.info()                      # files, tensors, config.json, manifest
    client.plan(4)                     # what every rank of tp=4 gets
    data = client.read_shard(1, 4)     # rank 1 of 4 as a bytearray (a safetensors file)
    client.pull(1, 4, "rank-1.safetensors")      # atomic, resumable, progress bar on a terminal
    for piece in client.iter_shard(1, 4): ...    # stream it (e.g. straight into parameters)

A broken connection is resumed with `Range: bytes=POS-` and `If-Range: ETAG`: if the shard changed on
the server meanwhile (its ETag names the source files, manifest, tp and rank) the bytes already
received are stale and `IntegrityError` is raised instead of mixing versions. At the end the total
length and the sha256 (from the server's digest) are checked. Failures are retried by
`reshard.io.retry` (waits doubling from `backoff`, at most 10 s; `retries` in a row, then an error).
Every body, JSON answers included, is read at a minimum pace (`reshard.io.client.pace`: a server that
stalls or trickles fails the try) and up to a cap (a JSON answer `MAX_JSON_BYTES`, a file the size it
was listed with), and a URL's `user:password@` is taken out of it at once and sent as a header
(`wire.without_credentials`), so that no message shows it. `pull` and `pull_meta` publish files
through `reshard.io.client.publish` (exclusive temp files; a shard parsed and checked before its rename).

Why the service has two client stacks, this one on httpx and `ShardBody` (`reshard.io.client.body`)
on the standard library's `http.client` (measured on the 2-core dev VM, Python 3.11, httpx 0.29,
loopback, a stdlib server, best of 3-5 runs, two sessions):
- `fill_model` needs `http.client`: `import httpx` takes 120-160 ms against 24-30 ms for `http.client`
  (`python -X importtime`; on a loaded machine both grow, httpx stays 4-7x), paid by every TP worker before
  its first byte; and a 256 MiB body arrives in 0.23-0.37 s through `readinto` straight into the
  destination against 1.8-2.2 s through httpx's `iter_raw` plus the copy out of its pieces.
- this client needs httpx: it honours the environment's proxy and CA settings (`HTTPS_PROXY`,
  `NO_PROXY`, `SSL_CERT_FILE`, `.netrc`), which `reshard pull` and vLLM's loader get through it and
  `http.client` does not have; it keeps one connection pool across the JSON calls, a pull and its
  resumes, with separate connect and read timeouts; and tests hand it a `transport`. Per request it
  costs more (2.4-2.8 ms against 0.8 ms for a small keep-alive GET), which a pull of a few JSON calls and
  one body does not feel. Both share the URLs, headers and retry policy (`wire`, `reshard.io.retry`),
  and `ShardBody` raises an error answer through this client, so both fail alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from reshard.errors import IntegrityError, ReshardError
from reshard.format.meta_files import check_listing
from reshard.io.client.pace import Pace, PaceLimits
from reshard.io.client.wire import (
    MAX_JSON_BYTES,
    RETRY_CAP,
    SHA_HEADER,
    answer_error,
    auth_headers,
    layout_params,
    without_credentials,
)
from reshard.io.client.wire import checkpoint_url as as_checkpoint_url
from reshard.io.hashing import BackgroundHash
from reshard.io.retry import Backoff, Retries, Retryable, announce
from reshard.layout.mesh import Layout

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_RETRY_STATUS = frozenset({500, 502, 503, 504})
_ERROR_BYTES = 64 << 10  # of an error answer's body, what is read to name the error

_RETRY_ON = (httpx.TransportError, Retryable)


@dataclass(frozen=True)
class ShardHead:
    """What `HEAD` says about a shard: its size, ETag and (once the server knows it) sha256."""

    size: int
    etag: str
    sha256: str | None = None


@dataclass(frozen=True)
class Answer:
    """A small answer of the service, read whole: status, headers, body, and `what` was asked (for errors)."""

    status: int
    headers: httpx.Headers
    body: bytes
    what: str

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise IntegrityError(f"{self.what}: the answer is not JSON: {self.body[:100]!r}") from None


class ShardClient:
    """A client for one checkpoint URL `http://HOST:PORT/v1/checkpoints/NAME`."""

    def __init__(self, checkpoint_url: str, *, token: str | None = None, retries: int = 5, timeout: float = 60.0,
                 backoff: float = 0.25, rules: str | None = None, engine: str | None = None, verify: bool = True,
                 transport: httpx.BaseTransport | None = None, pace: PaceLimits | None = None,
                 credentials: dict[str, str] | None = None) -> None:
        """`credentials`: the Authorization header a URL's `user:password@` stood for, where the caller
        took them out already (`wire.without_credentials`)."""
        url, basic = without_credentials(as_checkpoint_url(checkpoint_url))
        basic = basic or credentials or {}
        self.url, self.retries, self.backoff, self.verify = url, retries, backoff, verify
        self.params = {k: v for k, v in (("rules", rules), ("engine", engine)) if v}
        self.timeout = timeout
        self.pace = pace or PaceLimits.from_settings()
        self._http = httpx.Client(headers={**auth_headers(token), **basic},
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), transport=transport)

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- JSON endpoints ------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """The checkpoint: files, tensors (dtype, shape, bytes), config.json, manifest source."""
        return self._json("GET", self.url)

    def plan(self, tp: int | Layout, *, tensors: bool = True) -> dict[str, Any]:
        """The plan of every rank of `tp` (what each rank file contains), with each shard's ETag."""
        return self._json("GET", f"{self.url}/plan", params={**layout_params(tp), "tensors": str(tensors).lower()})

    def digest(self, rank: int, tp: int | Layout) -> dict[str, Any]:
        """`{"sha256", "size", "etag", ...}` of a shard (the server streams it once, then caches)."""
        return self._json("GET", self.shard_url(rank) + "/digest", params=layout_params(tp),
                          timeout=httpx.Timeout(max(self.timeout, 600.0), connect=min(self.timeout, 10.0)))

    def head(self, rank: int, tp: int | Layout) -> ShardHead:
        """Size, ETag and (if known) sha256 of a shard. Asks for its first byte rather than HEAD, so
        that errors come with the server's JSON explanation."""
        a = self._request("GET", self.shard_url(rank), params={**self.params, **layout_params(tp)},
                          headers={"Range": "bytes=0-0", "Accept-Encoding": "identity"}, cap=1)
        _, size = _body_span(a.status, a.headers, 0, a.what)
        if size is None or "etag" not in a.headers:
            raise IntegrityError(f"{a.what}: the answer names no size or no ETag; is this the service?")
        return ShardHead(size, a.headers["etag"], a.headers.get(SHA_HEADER))

    def meta_listing(self) -> list[dict[str, Any]]:
        """The checkpoint's small files (name, size, sha256), every entry checked (`check_listing`)."""
        return check_listing(self._json("GET", f"{self.url}/meta"), f"{self.url}/meta")

    def pull_meta(self, dest: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Copy the checkpoint's small files (config.json, tokenizer, generation config) into the directory
        `dest` (`reshard.io.client.publish.pull_meta`). Returns the server's list (name, size, sha256)."""
        from reshard.io.client.publish import pull_meta

        return pull_meta(self, dest)

    def meta_file(self, filename: str) -> bytes | None:
        """One of the checkpoint's small files (`reshard.format.meta_files`), verified against the size and
        sha256 the server lists for it; None when the checkpoint has none."""
        listed = {f["name"]: f for f in self.meta_listing()}
        if filename not in listed:
            return None
        return b"".join(piece for _pos, _size, piece in self.meta_pieces(listed[filename]))

    def meta_pieces(self, entry: dict[str, Any]) -> Iterator[tuple[int, int, bytes]]:
        """(offset, size, bytes) of the listed small file `entry`: at most its listed size, hashed, checked."""
        url = f"{self.url}/meta/{entry['name']}"
        sha = hashlib.sha256()
        with BackgroundHash(sha) as hasher:
            yield from self._fetch(url, {}, start=0, etag=None, size=entry["size"], hasher=hasher, what=url)
        if sha.hexdigest() != entry["sha256"]:
            raise IntegrityError(f"{url}: sha256 of the {entry['size']} bytes received is {sha.hexdigest()}, the "
                                 f"listing says {entry['sha256']}; nothing was written, pull again")

    def shard_url(self, rank: int) -> str:
        return f"{self.url}/shards/{rank}"

    # --- shard bytes -------------------------------------------------------------------------

    def iter_shard(self, rank: int, tp: int | Layout, *, start: int = 0) -> Iterator[bytes]:
        """The shard's bytes from `start`, resuming after broken connections; verified at the end
        (the sha256 only when `start` is 0, since the bytes before it are not seen)."""
        for _pos, _size, piece in self.pieces(rank, tp, start=start):
            yield piece

    def read_shard(self, rank: int, tp: int | Layout) -> bytearray:
        """The whole shard in memory (a safetensors file: `safetensors.torch.load(bytes(...))`)."""
        out: bytearray | None = None
        for pos, size, piece in self.pieces(rank, tp):
            if out is None:
                out = bytearray(size)
            out[pos : pos + len(piece)] = piece
        assert out is not None
        return out

    def pull(self, rank: int, tp: int | Layout, dest: str | os.PathLike[str], *, progress: bool | None = None,
             resume: bool = True) -> dict[str, Any]:
        """Download to `dest` atomically, resumably, parsed and checked before it is published
        (`reshard.io.client.publish.pull_shard`). Returns path, size, sha256, etag, resumed_from and kept."""
        from reshard.io.client.publish import pull_shard

        return pull_shard(self, rank, tp, dest, progress=progress, resume=resume)

    def pieces(self, rank: int, tp: int | Layout, *, start: int = 0, etag: str | None = None, size: int | None = None,
               sha: Any = None) -> Iterator[tuple[int, int, bytes]]:
        """(offset, shard size, bytes) from `start`; `sha` is fed every byte when given (else a fresh
        one when start is 0 and verification is on); `etag` and `size` pin the shard version (what `head`
        said). Verified at the end against the server's sha256 (when hashed)."""
        if sha is None and start == 0 and self.verify:
            sha = hashlib.sha256()
        url, params = self.shard_url(rank), {**self.params, **layout_params(tp)}
        what = f"{url}?{'&'.join(f'{k}={v}' for k, v in layout_params(tp).items())}"
        with BackgroundHash(sha) as hasher:
            server = yield from self._fetch(url, params, start=start, etag=etag, size=size, hasher=hasher, what=what)
        if sha is not None and self.verify:
            want = server.sha256
            if want is None:
                d = self.digest(rank, tp)
                if d["etag"] != server.etag:
                    raise IntegrityError(f"{what}: the shard changed on the server during the download")
                want = d["sha256"]
            got = sha.hexdigest()
            if got != want:
                raise IntegrityError(f"{what}: sha256 of the {server.size} bytes received is {got}, "
                                     f"the server says {want}; pull again")

    def _fetch(self, url: str, params: dict[str, Any], *, start: int, etag: str | None, size: int | None,
               hasher: BackgroundHash, what: str) -> Iterator[tuple[int, int, bytes]]:
        """GET `url`'s body from `start` (resumed with Range after failures), at most `size` bytes where it
        is known, at the pace; returns its `ShardHead` (size, ETag, the sha256 the server sent)."""
        pos, server_sha = start, None
        pace = Pace(self.pace)
        timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0), read=self.pace.read_timeout(self.timeout))
        tries = self._tries(lambda e: ReshardError(f"{what}: giving up after {self.retries} retries at byte {pos}: {e}"))
        while size is None or pos < size:
            headers = {"Accept-Encoding": "identity"}  # raw bytes are read: no content coding
            if pos:
                headers["Range"] = f"bytes={pos}-"
            if pos and etag:
                headers["If-Range"] = etag
            pace.restart()
            try:
                with self._http.stream("GET", url, params=params, headers=headers, timeout=timeout) as r:
                    if r.status_code == 416 and pos and _total(r.headers.get("content-range")) == pos:
                        size = pos  # the bytes before `start` were the whole body
                        break
                    if r.status_code >= 400:
                        self._check(r.status_code, _head_of(r), f"GET {r.request.url}")
                    got = r.headers.get("etag")
                    if etag is not None and got != etag:
                        raise IntegrityError(f"{what}: the shard changed on the server (ETag {etag} -> {got}); "
                                             "the bytes received so far are stale, pull again")
                    etag = got
                    skip, total = _body_span(r.status_code, r.headers, pos, what)
                    if size is not None and total is not None and total != size:
                        raise IntegrityError(f"{what}: the server said {size} bytes, now {total}")
                    size = total if size is None else size
                    if size is None:
                        raise IntegrityError(f"{what}: the answer has no Content-Length; is this the service?")
                    server_sha = r.headers.get(SHA_HEADER) or server_sha
                    for piece in r.iter_raw():
                        if skip:
                            cut = min(skip, len(piece))
                            piece, skip = piece[cut:], skip - cut
                            if not piece:
                                continue
                        if pos + len(piece) > size:  # a body without a length, running past what was listed
                            raise IntegrityError(f"{what}: the body runs past the {size} bytes it was listed with; "
                                                 "nothing was written")
                        hasher.update(piece)
                        yield pos, size, piece
                        pos += len(piece)
                        if pace.got(len(piece)):  # a trickle is no progress: `Stalled` once under the pace
                            tries.progressed()
                    if pos < size:
                        raise Retryable(f"connection closed at byte {pos} of {size}")
            except _RETRY_ON as e:
                tries.failed(e)
        if size is None or pos != size:
            raise IntegrityError(f"{what}: received {pos} bytes, expected {size}")
        return ShardHead(size, etag or "", server_sha)

    # --- plumbing ----------------------------------------------------------------------------

    def _json(self, method: str, url: str, **kw: Any) -> Any:
        return self._request(method, url, **kw).json()

    def _request(self, method: str, url: str, *, params: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None, timeout: Any = None, cap: int = MAX_JSON_BYTES) -> Answer:
        """A small answer, read whole at the pace and at most `cap` bytes (an `IntegrityError` beyond), tried
        again after broken connections, stalls and 5xx; a 4xx raised as the library error the server names."""
        params = {**self.params, **(params or {})}

        def once() -> Answer:
            pace = Pace(self.pace)
            with self._http.stream(method, url, params=params, headers=headers,
                                   timeout=timeout or httpx.USE_CLIENT_DEFAULT) as r:
                what = f"{method} {r.request.url}"
                body = _head_of(r) if r.status_code >= 400 else _read_capped(r, cap, pace, what)
                a = Answer(r.status_code, r.headers, body, what)
            self._check(a.status, a.body, a.what)
            return a

        tries = self._tries(lambda e: ReshardError(f"{self.url}: giving up after {self.retries} retries: {e}"))
        return tries.call(once, retry_on=_RETRY_ON)

    def _tries(self, give_up: Callable[[BaseException], BaseException]) -> Retries:
        """The failures of one request or transfer: waits doubling from `backoff`, at most `RETRY_CAP`
        seconds; `give_up(error)` raised after `retries` of them in a row."""
        return Retries(Backoff(self.retries, self.backoff, RETRY_CAP), give_up=give_up,
                       on_retry=announce(self.url, self.retries))

    @staticmethod
    def _check(status: int, body: bytes, what: str) -> None:
        """Raise the library error the server named for a 4xx; `Retryable` for a 5xx."""
        if status < 400:
            return
        if status in _RETRY_STATUS:
            raise Retryable(f"HTTP {status}")
        raise answer_error(status, body, what)


def _read_capped(r: httpx.Response, cap: int, pace: Pace, what: str) -> bytes:
    """`r`'s (decoded) body, at most `cap` bytes, read at `pace`."""
    length = r.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap and r.headers.get("content-encoding", "identity") == "identity":
        raise IntegrityError(f"{what}: the answer is {length} bytes, over the {cap} a client takes")
    body = bytearray()
    for piece in r.iter_bytes():
        body += piece
        if len(body) > cap:
            raise IntegrityError(f"{what}: the answer runs past the {cap} bytes a client takes")
        pace.got(len(piece))
    return bytes(body)


def _head_of(r: httpx.Response) -> bytes:
    """The first bytes of an error answer's body (enough to name the error; a huge one is not read)."""
    out = bytearray()
    for piece in r.iter_bytes():
        out += piece
        if len(out) >= _ERROR_BYTES:
            break
    return bytes(out[:_ERROR_BYTES])


def _total(content_range: str | None) -> int | None:
    m = re.match(r"^bytes \*/(\d+)$", content_range or "")
    return int(m.group(1)) if m else None


def _body_span(status: int, headers: httpx.Headers, pos: int, what: str) -> tuple[int, int | None]:
    """(bytes to skip at the start of the body, total size; None when a 200 names none) of a 200 or 206."""
    if status == 206:
        m = _CONTENT_RANGE.match(headers.get("content-range", ""))
        if m is None or int(m.group(1)) != pos:
            raise IntegrityError(f"{what}: asked for bytes {pos}-, got Content-Range {headers.get('content-range')!r}")
        return 0, int(m.group(3))
    if status != 200:
        raise ReshardError(f"{what}: unexpected HTTP {status}")
    length = headers.get("content-length", "")
    return pos, int(length) if length.isdigit() else None  # the server ignored Range: skip what we have

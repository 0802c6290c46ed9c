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

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from reshard.errors import IntegrityError, OutputPathError, ReshardError
from reshard.format.rank_file import rank_file_name
from reshard.io.client.wire import RETRY_CAP, SHA_HEADER, answer_error, as_world, auth_headers, layout_params
from reshard.io.client.wire import checkpoint_url as as_checkpoint_url
from reshard.io.hashing import BackgroundHash, file_sha256
from reshard.io.outfs import check_space, fsync_dir, made_dir, output_errors
from reshard.io.progress import Progress
from reshard.io.retry import Backoff, Retries, Retryable, announce
from reshard.layout.mesh import Layout

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_RETRY_STATUS = frozenset({500, 502, 503, 504})


_RETRY_ON = (httpx.TransportError, Retryable)


@dataclass(frozen=True)
class ShardHead:
    """What `HEAD` says about a shard: its size, ETag and (once the server knows it) sha256."""

    size: int
    etag: str
    sha256: str | None = None


class ShardClient:
    """A client for one checkpoint URL `http://HOST:PORT/v1/checkpoints/NAME`."""

    def __init__(self, checkpoint_url: str, *, token: str | None = None, retries: int = 5, timeout: float = 60.0,
                 backoff: float = 0.25, rules: str | None = None, engine: str | None = None, verify: bool = True,
                 transport: httpx.BaseTransport | None = None) -> None:
        url = as_checkpoint_url(checkpoint_url)
        self.url, self.retries, self.backoff, self.verify = url, retries, backoff, verify
        self.params = {k: v for k, v in (("rules", rules), ("engine", engine)) if v}
        self.timeout = timeout
        self._http = httpx.Client(headers=auth_headers(token), timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  transport=transport)

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
        r = self._call(lambda: self._http.get(self.shard_url(rank), params={**self.params, **layout_params(tp)},
                                              headers={"Range": "bytes=0-0", "Accept-Encoding": "identity"}))
        _, size = _body_span(r, 0)
        return ShardHead(size, r.headers["etag"], r.headers.get(SHA_HEADER))

    def pull_meta(self, dest: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Copy the checkpoint's small files (config.json, tokenizer, generation config) into the directory
        `dest`, each verified against the server's sha256 and published with a rename; a file already
        there with the same digest is kept. Returns the server's list (name, size, sha256)."""
        dest = Path(dest)
        files = self._json("GET", f"{self.url}/meta")["files"]
        with made_dir(dest, for_file=dest / "config.json"), output_errors(dest, retry="run the same pull again"):
            for f in files:
                path = dest / f["name"]
                if path.is_file() and path.stat().st_size == f["size"] and file_sha256(path) == f["sha256"]:
                    continue
                data = self._call(lambda f=f: self._http.get(f"{self.url}/meta/{f['name']}")).content
                if hashlib.sha256(data).hexdigest() != f["sha256"]:
                    raise IntegrityError(f"{self.url}/meta/{f['name']}: sha256 does not match the listing; pull again")
                tmp = dest / f".{f['name']}.part"
                tmp.write_bytes(data)
                os.replace(tmp, path)
            fsync_dir(dest)
        return files

    def meta_file(self, filename: str) -> bytes | None:
        """One of the checkpoint's small files (`reshard.format.meta_files`), verified against the sha256
        the server lists for it; None when the checkpoint has none."""
        listed = {f["name"]: f for f in self._json("GET", f"{self.url}/meta")["files"]}
        if filename not in listed:
            return None
        data = self._call(lambda: self._http.get(f"{self.url}/meta/{filename}")).content
        if hashlib.sha256(data).hexdigest() != listed[filename]["sha256"]:
            raise IntegrityError(f"{self.url}/meta/{filename}: sha256 does not match the listing; fetch again")
        return data

    def shard_url(self, rank: int) -> str:
        return f"{self.url}/shards/{rank}"

    # --- shard bytes -------------------------------------------------------------------------

    def iter_shard(self, rank: int, tp: int | Layout, *, start: int = 0) -> Iterator[bytes]:
        """The shard's bytes from `start`, resuming after broken connections; verified at the end
        (the sha256 only when `start` is 0, since the bytes before it are not seen)."""
        for _pos, _size, piece in self._pieces(rank, tp, start=start):
            yield piece

    def read_shard(self, rank: int, tp: int | Layout) -> bytearray:
        """The whole shard in memory (a safetensors file: `safetensors.torch.load(bytes(...))`)."""
        out: bytearray | None = None
        for pos, size, piece in self._pieces(rank, tp):
            if out is None:
                out = bytearray(size)
            out[pos : pos + len(piece)] = piece
        assert out is not None
        return out

    def pull(self, rank: int, tp: int | Layout, dest: str | os.PathLike[str], *, progress: bool | None = None,
             resume: bool = True) -> dict[str, Any]:
        """Download to `dest` atomically (temp file + fsync + rename). A partial temp file left by an
        earlier try of the same shard (same ETag) is resumed; a `dest` that is already this shard (its
        size and the server's sha256) is verified and kept, nothing written (a full or read-only disk
        is no obstacle then). Returns path, size, sha256, etag, resumed_from and kept.

        A pull that fails before any byte lands leaves nothing: no `.part`, no `.part.json`, no
        directory it made; one that fails later keeps its partial file to resume from (unless the
        bytes are wrong: `IntegrityError`)."""
        dest = Path(dest)
        part, meta = dest.with_name(f".{dest.name}.part"), dest.with_name(f".{dest.name}.part.json")
        head = self.head(rank, tp)
        with made_dir(dest.parent, for_file=dest):
            if dest.is_dir():
                raise OutputPathError(f"{dest}: is a directory; give the file to write, e.g. {dest / rank_file_name(rank, as_world(tp))}")
            digest = self._in_place(rank, tp, dest, head)
            if digest is not None:
                for p in (part, meta):  # a leftover of an earlier try: the shard is here already
                    with contextlib.suppress(OSError):
                        p.unlink()
                return {"path": str(dest), "rank": rank, "tp": tp, "size": head.size, "sha256": digest,
                        "etag": head.etag, "resumed_from": head.size, "kept": True}
            start, digest = self._download(rank, tp, dest, part, meta, head, progress=progress, resume=resume)
        return {"path": str(dest), "rank": rank, "tp": tp, "size": head.size, "sha256": digest,
                "etag": head.etag, "resumed_from": start, "kept": False}

    def _in_place(self, rank: int, tp: int | Layout, dest: Path, head: ShardHead) -> str | None:
        """The sha256 of `dest` if it already is the shard `head` describes (size, then the server's
        sha256), else None."""
        try:
            if not dest.is_file() or dest.stat().st_size != head.size:
                return None
            digest = file_sha256(dest)
        except OSError:  # unreadable: downloaded again (and any error of the output side said then)
            return None
        want = head.sha256
        if want is None:
            d = self.digest(rank, tp)
            want = d["sha256"] if d["etag"] == head.etag else None  # changed meanwhile: download the new one
        return digest if digest == want else None

    def _download(self, rank: int, tp: int | Layout, dest: Path, part: Path, meta: Path, head: ShardHead, *,
                  progress: bool | None, resume: bool) -> tuple[int, str]:
        """Into `part` (resumed where `meta` names this shard's ETag), verified, renamed to `dest`;
        (the offset it resumed from, sha256)."""
        retry = f"run the same pull again (it resumes from {part.name})"
        version = {"url": self.shard_url(rank), **layout_params(tp), "etag": head.etag}
        sha, start = hashlib.sha256(), 0
        resuming = resume and part.is_file() and _read_meta(meta) == version
        bar = Progress(head.size, f"rank {rank}/{as_world(tp)}", enabled=progress)
        try:
            with output_errors(dest, retry=retry):  # out of space etc.: the partial file stays, to resume
                if resuming:
                    start = min(part.stat().st_size, head.size)
                    with open(part, "rb") as f:  # the bytes already here count towards the digest
                        left = start
                        while left and (block := f.read(min(8 << 20, left))):
                            sha.update(block)
                            left -= len(block)
                check_space(dest.parent, head.size - start, fix=f"free some space there or pull elsewhere, then {retry}")
                if not resuming:
                    meta.write_text(json.dumps(version))
                bar.update(start)
                with open(part, "r+b" if start else "wb", buffering=0) as f:
                    f.truncate(start)
                    f.seek(start)
                    for _pos, _size, piece in self._pieces(rank, tp, start=start, etag=head.etag, sha=sha):
                        view = memoryview(piece)
                        while view:
                            view = view[f.write(view):]
                        bar.update(len(piece))
                    os.fsync(f.fileno())
                os.replace(part, dest)
        except BaseException as e:
            # wrong bytes, or nothing received yet: nothing worth resuming from
            if isinstance(e, IntegrityError) or not _has_bytes(part):
                for p in (part, meta):
                    with contextlib.suppress(OSError):
                        p.unlink()
            raise
        finally:
            bar.close()
        with contextlib.suppress(FileNotFoundError):
            meta.unlink()
        fsync_dir(dest.parent)
        return start, sha.hexdigest()

    def _pieces(self, rank: int, tp: int | Layout, *, start: int = 0, etag: str | None = None,
                sha: Any = None) -> Iterator[tuple[int, int, bytes]]:
        """(offset, shard size, bytes) from `start`; `sha` is fed every byte when given (else a fresh
        one when start is 0 and verification is on); `etag` pins the shard version."""
        if sha is None and start == 0 and self.verify:
            sha = hashlib.sha256()
        with BackgroundHash(sha) as hasher:
            yield from self._fetch(rank, tp, start=start, etag=etag, hasher=hasher)

    def _fetch(self, rank: int, tp: int | Layout, *, start: int, etag: str | None,
               hasher: BackgroundHash) -> Iterator[tuple[int, int, bytes]]:
        pos, size, server_sha = start, None, None
        url, params = self.shard_url(rank), {**self.params, **layout_params(tp)}
        tries = self._tries(lambda e: ReshardError(f"{url}?tp={tp}: giving up after {self.retries} retries at byte {pos}: {e}"))
        while size is None or pos < size:
            headers = {"Accept-Encoding": "identity"}  # raw bytes are read: no content coding
            if pos:
                headers["Range"] = f"bytes={pos}-"
            if pos and etag:
                headers["If-Range"] = etag
            try:
                with self._http.stream("GET", url, params=params, headers=headers) as r:
                    if r.status_code == 416 and pos and _total(r.headers.get("content-range")) == pos:
                        size = pos  # the bytes before `start` were the whole shard
                        break
                    self._check(r)
                    got = r.headers.get("etag")
                    if etag is not None and got != etag:
                        raise IntegrityError(f"{url}?tp={tp}: the shard changed on the server (ETag {etag} -> {got}); "
                                             "the bytes received so far are stale, pull again")
                    etag = got
                    skip, total = _body_span(r, pos)
                    if size is not None and total != size:
                        raise IntegrityError(f"{url}?tp={tp}: size changed from {size} to {total} bytes")
                    size = total
                    server_sha = r.headers.get(SHA_HEADER) or server_sha
                    for piece in r.iter_raw():
                        if skip:
                            cut = min(skip, len(piece))
                            piece, skip = piece[cut:], skip - cut
                            if not piece:
                                continue
                        hasher.update(piece)
                        yield pos, size, piece
                        pos += len(piece)
                        tries.progressed()
                    if pos < size:
                        raise Retryable(f"connection closed at byte {pos} of {size}")
            except _RETRY_ON as e:
                tries.failed(e)
        if size is None or pos != size:
            raise IntegrityError(f"{url}?tp={tp}: received {pos} bytes, expected {size}")
        if hasher.active and self.verify:
            if server_sha is None:
                d = self.digest(rank, tp)
                if d["etag"] != etag:
                    raise IntegrityError(f"{url}?tp={tp}: the shard changed on the server during the download")
                server_sha = d["sha256"]
            got = hasher.hexdigest()
            if got != server_sha:
                raise IntegrityError(f"{url}?tp={tp}: sha256 of the {size} bytes received is {got}, "
                                     f"the server says {server_sha}; pull again")

    # --- plumbing ----------------------------------------------------------------------------

    def _json(self, method: str, url: str, **kw: Any) -> dict[str, Any]:
        params = {**self.params, **kw.pop("params", {})}
        r = self._call(lambda: self._http.request(method, url, params=params, **kw))
        return r.json()

    def _call(self, do: Callable[[], httpx.Response]) -> httpx.Response:
        """`do()`'s answer once it is not an error, tried again after broken connections and 5xx."""

        def checked() -> httpx.Response:
            r = do()
            self._check(r)
            return r

        tries = self._tries(lambda e: ReshardError(f"{self.url}: giving up after {self.retries} retries: {e}"))
        return tries.call(checked, retry_on=_RETRY_ON)

    def _tries(self, give_up: Callable[[BaseException], BaseException]) -> Retries:
        """The failures of one request or transfer: waits doubling from `backoff`, at most `RETRY_CAP`
        seconds; `give_up(error)` raised after `retries` of them in a row."""
        return Retries(Backoff(self.retries, self.backoff, RETRY_CAP), give_up=give_up,
                       on_retry=announce(self.url, self.retries))

    @staticmethod
    def _check(r: httpx.Response) -> None:
        """Raise the library error the server named for a 4xx; `Retryable` for a 5xx."""
        if r.status_code < 400:
            return
        if not r.is_closed:
            r.read()
        if r.status_code in _RETRY_STATUS:
            raise Retryable(f"HTTP {r.status_code}")
        raise answer_error(r.status_code, r.content, f"{r.request.method} {r.request.url}")


def _total(content_range: str | None) -> int | None:
    m = re.match(r"^bytes \*/(\d+)$", content_range or "")
    return int(m.group(1)) if m else None


def _body_span(r: httpx.Response, pos: int) -> tuple[int, int]:
    """(bytes to skip at the start of the body, total shard size) for a 200 or 206 answer."""
    if r.status_code == 206:
        m = _CONTENT_RANGE.match(r.headers.get("content-range", ""))
        if m is None or int(m.group(1)) != pos:
            raise IntegrityError(f"{r.request.url}: asked for bytes {pos}-, got Content-Range {r.headers.get('content-range')!r}")
        return 0, int(m.group(3))
    if r.status_code != 200:
        raise ReshardError(f"{r.request.url}: unexpected HTTP {r.status_code}")
    return pos, int(r.headers["content-length"])  # the server ignored Range: skip what we have


def _has_bytes(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _read_meta(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

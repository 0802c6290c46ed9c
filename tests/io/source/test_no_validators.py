"""A checkpoint behind a static HTTP server that sends no ETag and no Last-Modified: a file rewritten
there while it is read could not be told from the one planned (obstore reports the Unix epoch as its
mtime), so such a source is refused before any rank file is started. The same server sending
Last-Modified is read, and a rewrite mid-read (a new Last-Modified) fails the write with nothing
published; so does a rewrite within the same second as the file's last write (which keeps its
Last-Modified): the version is taken only once that second is over (`reshard.io.source.stores.settled`)."""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reshard.cli import main
from reshard.format.rank_file import rank_file_name
from reshard.io.source.remote_dir import SPECULATIVE
from reshard.io.source.stores import SETTLE
from tests.support.live import make_ckpt

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

SIZES = {"hidden_size": 512, "intermediate_size": 1024, "vocab_size": 2000, "num_attention_heads": 8,
         "num_key_value_heads": 8}  # one ~28 MB file: many ranged GETs per rank
TP = 2


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET and HEAD of the files under the server's root, with single `Range: bytes=A-[B]` support;
    Last-Modified only when the server's `last_modified` is set; never an ETag."""

    server: _RangeServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        path = self.server.root / self.path.split("?", 1)[0].lstrip("/")
        if ".." in self.path or not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m and int(m.group(1)) >= SPECULATIVE:
            self.server.data_request(path)  # a tensor's bytes, not a header
        size = path.stat().st_size
        start, end = 0, size
        if m:
            start, end = int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else size, size)
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if self.server.last_modified:
            self.send_header("Last-Modified", email.utils.formatdate(path.stat().st_mtime, usegmt=True))
        self.end_headers()
        if body:
            with open(path, "rb") as f:
                f.seek(start)
                self.wfile.write(f.read(end - start))


class _RangeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, *, last_modified: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.last_modified = root, last_modified
        self.on_data: Callable[[Path], None] | None = None
        self.data_requests = 0
        self.first_data_at: float | None = None  # time.time() of the first request for a tensor's bytes
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def data_request(self, path: Path) -> None:
        with self.lock:
            self.data_requests += 1
            self.first_data_at = self.first_data_at or time.time()
            if self.on_data is not None:
                hook, self.on_data = self.on_data, None
                hook(path)


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two versions of one checkpoint (same shapes and size, other weights) and their tp=2 rank files."""
    base = tmp_path_factory.mktemp("novalidators")
    out = {}
    for seed, label in ((0, "a"), (1, "b")):
        src = make_ckpt(base / label, seed=seed, **SIZES)
        assert main(["write", str(src), "--tp", str(TP), "-o", str(base / f"{label}-ref"), "--no-progress"]) == 0
        out[label], out[f"{label}-ref"] = src, base / f"{label}-ref"
    assert (out["a"] / "model.safetensors").stat().st_size == (out["b"] / "model.safetensors").stat().st_size
    return out


@contextlib.contextmanager
def _serve(root: Path, *, last_modified: bool) -> Iterator[_RangeServer]:
    srv = _RangeServer(root, last_modified=last_modified)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


@pytest.fixture(params=[False, True], ids=["no-validators", "last-modified"])
def served(request: pytest.FixtureRequest, versions: dict[str, Path], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_RangeServer, Path]]:
    """Version a of the checkpoint under a fresh root, behind the server (with or without Last-Modified)."""
    monkeypatch.setenv("RESHARD_STORE_RETRIES", "0")
    ck = tmp_path / "root" / "ck"
    shutil.copytree(versions["a"], ck)
    with _serve(tmp_path / "root", last_modified=request.param) as srv:
        yield srv, tmp_path / "root"


def _rewrite_with(new: Path) -> Callable[[Path], None]:
    """A hook that overwrites a served file in place with the other version's bytes (same size), its
    mtime moved on by a minute (Last-Modified has whole seconds)."""
    def rewrite(path: Path) -> None:
        st = path.stat()
        with open(path, "r+b") as f:
            f.write((new / path.name).read_bytes())
        os.utime(path, (st.st_atime + 60, st.st_mtime + 60))
    return rewrite


def test_a_file_rewritten_mid_read_never_gives_a_mixed_rank_file(served: tuple[_RangeServer, Path], versions: dict[str, Path],
                                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    srv, root = served
    srv.on_data = _rewrite_with(versions["b"])
    out = tmp_path / "out"
    rc = main(["write", f"{srv.url}/ck/", "--tp", str(TP), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("reshard: error: "), (rc, err)
    assert f"{srv.url}/ck/model.safetensors" in lines[0], lines[0]
    if srv.last_modified:  # read, and the rewrite is seen: a new Last-Modified than the one planned
        assert srv.data_requests > 0 and srv.on_data is None
        assert "replaced while being read" in lines[0], lines[0]
    else:  # refused from the headers, before any tensor's bytes are asked for
        assert "sends no ETag and no Last-Modified" in lines[0], lines[0]
        assert srv.data_requests == 0
    assert not out.exists() or not any(p.name.startswith("rank-") for p in out.iterdir())  # nothing published
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def test_plan_refuses_a_source_without_validators(served: tuple[_RangeServer, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    srv, _ = served
    rc = main(["plan", f"{srv.url}/ck/", "--tp", str(TP)])
    captured = capsys.readouterr()
    if srv.last_modified:  # a validator: planned as usual
        assert rc == 0 and f"tp={TP}" in captured.out, captured
    else:
        assert rc == 1 and captured.err.count("\n") == 1 and "sends no ETag and no Last-Modified" in captured.err


def test_unchanged_source_with_last_modified_is_written_as_local(versions: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The contrast: Last-Modified is enough of a validator, and the shards are the local ones."""
    shutil.copytree(versions["a"], tmp_path / "root" / "ck")
    with _serve(tmp_path / "root", last_modified=True) as srv:
        assert main(["write", f"{srv.url}/ck/", "--tp", str(TP), "-o", str(tmp_path / "out"), "--no-progress"]) == 0
        assert srv.data_requests > 0
    for r in range(TP):
        name = rank_file_name(r, TP)
        assert (tmp_path / "out" / name).read_bytes() == (versions["a-ref"] / name).read_bytes(), name


def _rewrite_in_place(new: Path) -> Callable[[Path], None]:
    """A hook that overwrites a served file in place with the other version's bytes (same size), as an
    editor or `cp` would: its mtime becomes the moment of the rewrite."""
    def rewrite(path: Path) -> None:
        with open(path, "r+b") as f:
            f.write((new / path.name).read_bytes())
    return rewrite


def test_a_rewrite_within_the_second_of_the_last_write_is_never_published(
        versions: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint is published at the start of a second and read at once; its first tensor read
    rewrites it in place. Read within that second (as before), the rewrite kept the Last-Modified the
    plan had, and the write gave exit 0 and a rank file of both versions. Now the version is taken
    `SETTLE` s after the Last-Modified, so the rewrite comes later and has a new one: refused, in one
    line, nothing published."""
    monkeypatch.setenv("RESHARD_STORE_RETRIES", "0")
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    with _serve(root, last_modified=True) as srv:
        time.sleep(1 - time.time() % 1)  # the start of a second: the copy and the read begin in it
        shutil.copytree(versions["a"], root / "ck", copy_function=shutil.copyfile)  # mtime: now
        published = int((root / "ck" / "model.safetensors").stat().st_mtime)  # its Last-Modified (whole seconds)
        srv.on_data = _rewrite_in_place(versions["b"])
        rc = main(["write", f"{srv.url}/ck/", "--tp", str(TP), "-o", str(out), "--no-progress"])
    lines = capsys.readouterr().err.splitlines()
    assert srv.on_data is None and srv.first_data_at is not None  # the rewrite happened, at the first tensor read
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("reshard: error: "), (rc, lines)
    assert f"{srv.url}/ck/model.safetensors: replaced while being read" in lines[0], lines[0]
    assert srv.first_data_at >= published + SETTLE, (srv.first_data_at, published)  # after the version was settled
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def test_a_source_that_keeps_changing_is_refused(versions: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A Last-Modified ahead of this machine's clock (a server's clock far ahead, or a file written on
    and on) never settles: after three reads, the plan is refused in one line naming the file."""
    monkeypatch.setenv("RESHARD_STORE_RETRIES", "0")
    shutil.copytree(versions["a"], tmp_path / "root" / "ck")
    ahead = time.time() + 3600
    for f in (tmp_path / "root" / "ck").iterdir():
        os.utime(f, (ahead, ahead))
    with _serve(tmp_path / "root", last_modified=True) as srv:
        t0 = time.monotonic()
        rc = main(["plan", f"{srv.url}/ck/", "--tp", str(TP)])
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1, err
    assert f"{srv.url}/ck/model.safetensors: modified within {SETTLE:g} s of each of 3 reads" in err, err
    assert took >= 3 * SETTLE, took  # it waited for the version to settle before it gave up

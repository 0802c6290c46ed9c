"""`reshard pull`, service uploads and service jobs on a full / read-only ext4 and tmpfs: one clean error
(a 507 or 503 JSON answer from the service, which keeps serving), no temp file, and a retry after space is
freed whose output is byte-identical to an uninterrupted run (a pull resumes from its partial file)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.io.sinks.writer import MANIFEST_NAME
from tests.support.fs import (
    KINDS,
    RANK0,
    RANK1,
    TP,
    Mount,
    assert_clean,
    get_mount,
    leftovers,
    listing,
    reshard,
)
from tests.support.live import CuttingProxy, LiveServer, live_server, run_job

pytestmark = pytest.mark.servers

NAME = "ck"


@pytest.fixture(scope="module")
def source_server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real `reshard serve` of the checkpoint, on the ordinary disk (what pulls download)."""
    root = tmp_path_factory.mktemp("pull-root")
    shutil.copytree(ckpt, root / NAME)
    with live_server(root, log_dir=tmp_path_factory.mktemp("pull-logs")) as srv:
        yield srv
        assert srv.alive() and "Traceback" not in srv.log(), srv.log()


def _pull(url: str, dest: Path) -> Any:
    return reshard("pull", url, "--rank", 1, "--tp", TP, "-o", dest, "--retries", 2, "--no-progress")


def test_pull_without_room_then_with(fs: Mount, source_server: LiveServer, reference: dict[str, Path]) -> None:
    dest = fs.path / RANK1
    fs.fill(leave=1 << 20)
    assert_clean(_pull(source_server.ckpt_url(NAME), dest), f"MB in {fs.path}", "MB free", "run the same pull again")
    assert not dest.exists()
    fs.unfill()
    r = _pull(source_server.ckpt_url(NAME), dest)
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == (reference["write"] / RANK1).read_bytes()
    assert listing(fs.path) == [RANK1] and [p.name for p in fs.path.glob(".*part*")] == []


def test_pull_running_out_midway_keeps_partial_and_resumes(fs: Mount, source_server: LiveServer,
                                                           reference: dict[str, Path]) -> None:
    """The connection breaks after 1 MiB and, before the client reconnects, others fill the disk."""
    dest = fs.path / RANK1
    part = fs.path / f".{RANK1}.part"
    upstream = ("127.0.0.1", int(source_server.url.rsplit(":", 1)[1]))
    with CuttingProxy(upstream, cut_after=1 << 20, cuts=1) as proxy:
        proxy.on_cut = lambda: fs.fill(leave=0)
        url = f"{proxy.url}/v1/checkpoints/{NAME}"
        assert_clean(_pull(url, dest), str(dest), "no space left on device", f"resumes from {part.name}")
        assert part.is_file() and not dest.exists()
        kept = part.stat().st_size
        assert 0 < kept < (reference["write"] / RANK1).stat().st_size
        fs.unfill()
        r = _pull(url, dest)
    assert r.returncode == 0, r.stderr
    assert "resumed at" in r.stdout, (r.stdout, r.stderr)  # the result, on stdout
    assert dest.read_bytes() == (reference["write"] / RANK1).read_bytes()
    assert not part.exists()


def test_pull_read_only_and_bad_paths(fs: Mount, source_server: LiveServer, reference: dict[str, Path]) -> None:
    url, dest = source_server.ckpt_url(NAME), fs.path / RANK1
    with fs.readonly():
        assert_clean(_pull(url, dest), "read-only file system")
    afile = fs.path / "afile"
    afile.write_bytes(b"x")
    assert_clean(_pull(url, afile / RANK1), f"{afile} is a file, not a directory")
    (fs.path / "adir").mkdir()
    assert_clean(_pull(url, fs.path / "adir"), "is a directory", f"adir/{RANK1}")
    assert leftovers(fs.path) == [] and afile.read_bytes() == b"x"
    assert _pull(url, dest).returncode == 0
    assert dest.read_bytes() == (reference["write"] / RANK1).read_bytes()


# --- the service writing to a small file system -----------------------------------------------------

@pytest.fixture(scope="module", params=KINDS)
def served_mount(request: pytest.FixtureRequest, mounts: dict[str, Any], ckpt: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mount, LiveServer]]:
    """A `reshard serve` whose root (uploads) and --out (jobs) are on the small file system."""
    m = get_mount(mounts, request.param)
    m.clean()
    m.keep.add("svc")
    svc = m.path / "svc"
    shutil.copytree(ckpt, svc / "root" / NAME)
    try:
        # the job database stays off the small file system: an open database keeps it from being remounted ro
        with live_server(svc / "root", out=svc / "out", log_dir=tmp_path_factory.mktemp("svc-logs"),
                         state=tmp_path_factory.mktemp("svc-state")) as srv:
            yield m, srv
            assert srv.alive() and "Traceback" not in srv.log(), srv.log()
    finally:
        m.keep.discard("svc")
        m.clean()


@pytest.fixture
def svc(served_mount: tuple[Mount, LiveServer]) -> Iterator[tuple[Mount, LiveServer]]:
    m, srv = served_mount
    yield m, srv
    m.set_readonly(False)
    m.unfill()
    for p in (m.path / "svc" / "root").iterdir():
        if p.name != NAME:
            shutil.rmtree(p)
    shutil.rmtree(m.path / "svc" / "out", ignore_errors=True)


def _healthy(srv: LiveServer) -> None:
    assert srv.alive(), srv.log()
    assert httpx.get(srv.url + "/healthz", timeout=10).status_code == 200
    assert httpx.get(srv.ckpt_url(NAME), timeout=10).status_code == 200


def _upload(srv: LiveServer, body: Any) -> httpx.Response:
    return httpx.put(f"{srv.ckpt_url('up')}/files/model.safetensors", content=body, timeout=60)


def _error(r: httpx.Response, status: int, name: str, *needles: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["error"] == name, body
    for needle in needles:
        assert needle in body["detail"], (needle, body)


def test_upload_without_room_answers_507(svc: tuple[Mount, LiveServer], reference: dict[str, Path]) -> None:
    m, srv = svc
    data = (reference["write"] / RANK1).read_bytes()
    m.fill(leave=1 << 20)
    r = _upload(srv, data)
    _error(r, 507, "NoSpaceError", f"needs {len(data) / 1e6:.1f} MB in up, ", "MB free")
    assert str(m.path) not in r.text  # the served root is not shown
    m.fill(leave=0)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the disk runs out while the body arrives
        for i in range(0, len(data), 256 << 10):
            yield data[i : i + (256 << 10)]

    _error(_upload(srv, chunks()), 507, "NoSpaceError", "no space left on device", "upload the file again")
    assert leftovers(m.path / "svc") == [] and not (m.path / "svc" / "root" / "up").exists()
    _healthy(srv)
    m.unfill()
    r = _upload(srv, data)
    assert r.status_code == 201, r.text
    assert (m.path / "svc" / "root" / "up" / "model.safetensors").read_bytes() == data


def test_upload_read_only_answers_503(svc: tuple[Mount, LiveServer], reference: dict[str, Path]) -> None:
    m, srv = svc
    data = (reference["write"] / RANK0).read_bytes()
    with m.readonly():
        _error(_upload(srv, data), 503, "ReadOnlyError", "read-only file system")
        _healthy(srv)
    assert _upload(srv, data).status_code == 201
    assert (m.path / "svc" / "root" / "up" / "model.safetensors").read_bytes() == data


@pytest.mark.parametrize("fault", ["full", "read-only", "out-is-a-file"])
def test_job_fails_with_typed_error_then_succeeds(svc: tuple[Mount, LiveServer], reference: dict[str, Path],
                                                  fault: str) -> None:
    m, srv = svc
    out = m.path / "svc" / "out" / NAME / f"tp-{TP}"
    if fault == "full":
        m.fill(leave=1 << 20)
        job = run_job(srv.url, NAME, TP)
        want = ("NoSpaceError", f"MB in OUT/{NAME}/tp-{TP}, ")  # no server path is shown
    elif fault == "read-only":
        (m.path / "svc" / "out").mkdir(exist_ok=True)
        with m.readonly():
            job = run_job(srv.url, NAME, TP)
        want = ("ReadOnlyError", "read-only file system")
    else:
        out.parent.mkdir(parents=True)
        out.write_bytes(b"in the way")
        job = run_job(srv.url, NAME, TP)
        want = ("OutputPathError", f"OUT/{NAME}/tp-{TP}: exists and is not a directory")
        out.unlink()
    assert job["state"] == "failed", job
    assert job["error"]["error"] == want[0] and want[1] in job["error"]["detail"], job
    assert leftovers(m.path / "svc") == [] and (not out.exists() or listing(out) == [])
    _healthy(srv)
    m.unfill()
    job = run_job(srv.url, NAME, TP)
    assert job["state"] == "done", job
    for name in (RANK0, RANK1):
        assert (out / name).read_bytes() == (reference["write"] / name).read_bytes()
    assert (out / MANIFEST_NAME).is_file()

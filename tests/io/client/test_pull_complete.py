"""`reshard pull` onto a file that already is the shard: verified (its sha256 against the server's) and
kept, on a full and on a read-only file system, where a download could not even start. A pull refused
before any byte lands (no room) leaves nothing: no `.part`, no `.part.json`, no directory it made."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fs import RANK1, TP, Mount, assert_clean, listing, reshard
from tests.support.live import LiveServer, live_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

NAME = "ck"


@pytest.fixture(scope="module")
def source_server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real `reshard serve` of the checkpoint, on the ordinary disk (what pulls download)."""
    root = tmp_path_factory.mktemp("pull-complete-root")
    shutil.copytree(ckpt, root / NAME)
    with live_server(root, log_dir=tmp_path_factory.mktemp("pull-complete-logs")) as srv:
        yield srv
        assert srv.alive() and "Traceback" not in srv.log(), srv.log()


def _pull(srv: LiveServer, dest: Path) -> Any:
    return reshard("pull", srv.ckpt_url(NAME), "--rank", 1, "--tp", TP, "-o", dest, "--retries", 2, "--no-progress")


def _everything(directory: Path) -> list[str]:
    """Every entry of a directory, hidden ones (temps, `.part`, `.part.json`) included."""
    return sorted(p.name for p in directory.iterdir() if p.name not in ("lost+found", ".ballast"))


def _verified(r: Any, dest: Path, want: bytes, inode: int) -> None:
    assert r.returncode == 0, (r.returncode, r.stderr)
    lines = r.stdout.splitlines()  # the result on stdout, nothing on stderr
    assert len(lines) == 1 and "already in place" in lines[0] and "verified, nothing downloaded" in lines[0], r.stdout
    assert r.stderr == "", r.stderr
    assert dest.stat().st_ino == inode and dest.read_bytes() == want  # the same file, untouched


def test_complete_file_on_a_full_disk_is_verified(fs: Mount, source_server: LiveServer,
                                                  reference: dict[str, Path]) -> None:
    want = (reference["write"] / RANK1).read_bytes()
    dest = fs.path / RANK1
    dest.write_bytes(want)
    fs.fill(leave=64 << 10)  # far less than the shard: a second copy could not be downloaded
    _verified(_pull(source_server, dest), dest, want, dest.stat().st_ino)
    assert _everything(fs.path) == [RANK1]


def test_complete_file_on_a_read_only_disk_is_verified(fs: Mount, source_server: LiveServer,
                                                       reference: dict[str, Path]) -> None:
    want = (reference["write"] / RANK1).read_bytes()
    dest = fs.path / RANK1
    dest.write_bytes(want)
    inode = dest.stat().st_ino
    with fs.readonly():
        _verified(_pull(source_server, dest), dest, want, inode)
    assert _everything(fs.path) == [RANK1]


def test_a_file_that_is_not_the_shard_is_replaced(fs: Mount, source_server: LiveServer,
                                                  reference: dict[str, Path]) -> None:
    want = (reference["write"] / RANK1).read_bytes()
    dest = fs.path / RANK1
    wrong = bytearray(want)
    wrong[len(want) // 2] ^= 0xFF  # same size, one byte off
    dest.write_bytes(wrong)
    r = _pull(source_server, dest)
    assert r.returncode == 0 and r.stdout.startswith("pulled rank 1 of tp=2"), r.stderr
    assert dest.read_bytes() == want
    assert _everything(fs.path) == [RANK1]


def test_a_pull_refused_for_room_leaves_nothing(fs: Mount, source_server: LiveServer) -> None:
    fs.fill(leave=64 << 10)
    (fs.path / "kept").mkdir()  # a directory that was there stays
    for dest in (fs.path / "kept" / RANK1, fs.path / "new" / "deeper" / RANK1):
        assert_clean(_pull(source_server, dest), "MB free", "run the same pull again")
        assert not dest.exists()
    assert _everything(fs.path / "kept") == []  # no .part, no .part.json
    assert _everything(fs.path) == ["kept"]  # no directory made for the refused pull
    fs.unfill()
    dest = fs.path / "new" / "deeper" / RANK1
    r = _pull(source_server, dest)
    assert r.returncode == 0, r.stderr
    assert listing(dest.parent) == [RANK1] and _everything(dest.parent) == [RANK1]

"""Sealed files (`reshard.io.sealed`) and the store cache's blocks: bytes changed in place, a seal
missing, a symlink in place of a block: never read, deleted, fetched again; the reference is the
object's own bytes. (The service's copies of gathered pieces use the same seal: tests/service/test_gathered.py.)"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reshard.io.sealed import TRAILER, Sealer, open_sealed, seal_fd
from reshard.io.source.store_cache import StoreCache

pytestmark = pytest.mark.pure

OBJECT = bytes((i * 7 + 3) % 251 for i in range(100_000))
BLOCK = 16 << 10


def _sealed(path: Path, data: bytes) -> None:
    s = Sealer()
    s.update(data)
    path.write_bytes(data + s.trailer())


def test_open_sealed_takes_only_whole_regular_sealed_files(tmp_path: Path) -> None:
    good = tmp_path / "good"
    _sealed(good, b"abc" * 1000)
    fd = open_sealed(good, 3000)
    assert fd is not None and os.pread(fd, 3000, 0) == b"abc" * 1000
    os.close(fd)
    assert open_sealed(good, 2999) is None and not good.exists()  # the wrong size: deleted
    for name, body in (("flipped", b"abd" + b"abc" * 999), ("unsealed", b"abc" * 1000 + bytes(TRAILER))):
        _sealed(tmp_path / name, b"abc" * 1000)
        data = bytearray((tmp_path / name).read_bytes())
        data[: len(body)] = body
        (tmp_path / name).write_bytes(bytes(data))
        assert open_sealed(tmp_path / name) is None and not (tmp_path / name).exists(), name
    outside = tmp_path / "outside"
    _sealed(outside, b"secret")
    (tmp_path / "link").symlink_to(outside)
    assert open_sealed(tmp_path / "link") is None and not (tmp_path / "link").exists()
    assert outside.exists()  # the link is removed, never what it points to
    assert open_sealed(tmp_path / "absent") is None


def test_seal_fd_seals_a_file_written_out_of_order(tmp_path: Path) -> None:
    path = tmp_path / "copy"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, b"tail", 4096)
    os.pwrite(fd, b"head", 0)
    seal_fd(fd, 4100)
    os.close(fd)
    fd = open_sealed(path, 4100)
    assert fd is not None and os.pread(fd, 4, 4096) == b"tail"
    os.close(fd)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[tuple[StoreCache, list[tuple[int, int]]]]:
    calls: list[tuple[int, int]] = []
    yield StoreCache(tmp_path / "cache", 1 << 30, block=BLOCK), calls


def _fetch(calls: list[tuple[int, int]]):  # noqa: ANN202
    def fetch(lo: int, hi: int) -> Iterator[memoryview]:
        calls.append((lo, hi))
        yield memoryview(OBJECT[lo:hi])
    return fetch


def test_blocks_changed_in_place_or_replaced_by_links_are_fetched_again(cache: tuple[StoreCache, list], tmp_path: Path) -> None:
    store, calls = cache
    fetch = _fetch(calls)
    assert bytes(store.read(fetch, "s3://b/o", "v1", len(OBJECT), 0, len(OBJECT))) == OBJECT
    blocks = sorted((p for p in (tmp_path / "cache").glob("*/*") if p.name.isdigit()), key=lambda p: int(p.name))
    n = len(blocks)
    assert n == -(-len(OBJECT) // BLOCK) and len(calls) == n
    assert bytes(store.read(fetch, "s3://b/o", "v1", len(OBJECT), 0, len(OBJECT))) == OBJECT and len(calls) == n
    time.sleep(0.05)  # later: the file system's clock (coarse, a tick of a few ms) has moved on
    for p in blocks:  # 4 KiB of every block overwritten in place (its size kept)
        with open(p, "r+b") as f:
            f.write(b"\xff" * 4096)
    outside = tmp_path / "outside"
    outside.write_bytes(b"\x00" * (BLOCK + TRAILER))
    blocks[1].unlink()
    blocks[1].symlink_to(outside)
    assert bytes(store.read(fetch, "s3://b/o", "v1", len(OBJECT), 0, len(OBJECT))) == OBJECT
    assert len(calls) == 2 * n  # every block fetched again, none served as found
    assert outside.read_bytes() == b"\x00" * (BLOCK + TRAILER) and not blocks[1].is_symlink()
    assert bytes(store.read(fetch, "s3://b/o", "v1", len(OBJECT), 0, len(OBJECT))) == OBJECT and len(calls) == 2 * n

"""`reshard write` and `reshard merge` on a full ext4 / tmpfs, read-only ones, and `-o` paths that cannot
be directories: one clean line, exit status 1, no temp file, and a rerun that resumes (kept rank files)
to output byte-identical to an uninterrupted run."""

from __future__ import annotations

import errno
import json
import mmap
import os
import time
from pathlib import Path

import pytest

from reshard.errors import NoSpaceError
from reshard.format.checkpoint import Source
from reshard.io.sinks import outfile
from reshard.io.sinks.write import write_shards
from reshard.io.sinks.writer import PARTIAL_NAME
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.plan.types import Plan
from tests.support.fs import (
    RANK0,
    RANK1,
    TP,
    Mount,
    assert_clean,
    leftovers,
    listing,
    mounted,
    reshard,
    same_tree,
)

pytestmark = pytest.mark.multiproc


def test_write_without_room_says_so_before_writing(fs: Mount, ckpt: Path, reference: dict[str, Path]) -> None:
    out = fs.path / "out"
    fs.fill(leave=1 << 20)
    needed = sum((reference["write"] / n).stat().st_size for n in (RANK0, RANK1))
    line = assert_clean(reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress"),
                        f"needs {needed / 1e6:.1f} MB in {out}", "MB free")
    free_said = float(line.split(", ")[1].split(" MB free")[0])
    assert abs(free_said * 1e6 - fs.free()) < 0.2e6, (line, fs.free())
    assert not out.exists()  # the directory it made is removed: nothing was published
    fs.unfill()
    r = reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "ranks 0-1 written" in r.stdout, r.stdout
    same_tree(reference["write"], out)


def test_write_running_out_midway_resumes_keeping_rank_0(fs: Mount, ckpt: Path, reference: dict[str, Path]) -> None:
    """Others fill the disk while rank 1 is being written: ENOSPC (never SIGBUS, even on tmpfs), rank 0
    stays published, no reshard.json; the rerun keeps rank 0 and writes rank 1. One writer, so that
    rank 1 starts after rank 0 (the next test has them written at once)."""
    out = fs.path / "out"
    src, plan = _source_and_plan(ckpt)
    seen = {"bytes": 0, "filled": False}

    def on_bytes(n: int) -> None:
        seen["bytes"] += n
        if not seen["filled"] and seen["bytes"] > plan.ranks[0].size:
            deadline = time.monotonic() + 30  # rank 0's publish (in the writer's pool) is recorded first
            while RANK0 not in _partial(out) and time.monotonic() < deadline:
                time.sleep(0.01)
            fs.fill(leave=0)
            seen["filled"] = True

    with pytest.raises(NoSpaceError, match=f"{RANK1}: no space left on device .*run the same command again"):
        write_shards(src, plan, out, progress=False, on_bytes=on_bytes, writers=1)
    assert seen["filled"]
    assert leftovers(out) == []
    assert listing(out) == [RANK0]
    assert (out / RANK0).read_bytes() == (reference["write"] / RANK0).read_bytes()
    fs.unfill()
    r = reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "rank 0 kept, rank 1 written" in r.stdout, r.stdout
    same_tree(reference["write"], out)
    assert not (out / PARTIAL_NAME).exists()
    r = reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress")  # complete: nothing to write
    assert "ranks 0-1 kept" in r.stdout and "written" not in r.stdout, r.stdout


def test_ranks_written_at_once_running_out_publish_nothing_partial(fs: Mount, ckpt: Path,
                                                                   reference: dict[str, Path]) -> None:
    """Two writers, so both ranks are on their way when others fill the disk: ENOSPC naming a rank
    file (not the stop the other writer got), no temp file, nothing published; the rerun writes the
    reference's directory."""
    out = fs.path / "out"
    filled: list[int] = []

    def fill_once(n: int) -> None:
        if not filled:
            fs.fill(leave=0)
        filled.append(n)

    with pytest.raises(NoSpaceError, match=r"rank-0000[01]-of-00002\.safetensors: no space left on device"):
        write_shards(*_source_and_plan(ckpt), out, progress=False, on_bytes=fill_once, writers=2)
    assert filled
    # full from the first piece handed over, before any buffer went out: neither rank could be published,
    # so the directory the write made is gone (no temp file in it either)
    assert not out.exists()
    fs.unfill()
    r = reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    same_tree(reference["write"], out)


def test_write_where_o_direct_is_refused_at_open(tmp_path: Path, ckpt: Path, reference: dict[str, Path]) -> None:
    """ramfs refuses O_DIRECT and reports no size: the rank files go through the page cache, and the
    free-space check does not refuse a file system that says nothing of its size."""
    with mounted("ramfs", tmp_path / "ramfs", size_mb=0) as m:
        with pytest.raises(OSError) as refused:
            os.open(m.path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
        assert refused.value.errno == errno.EINVAL
        r = reshard("write", ckpt, "--tp", TP, "-o", m.path / "out", "--no-progress")
        assert r.returncode == 0, r.stderr
        same_tree(reference["write"], m.path / "out")


def test_write_where_o_direct_refuses_the_alignment(tmp_path: Path, ckpt: Path, reference: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An ext4 on 4096-byte sectors, written with O_DIRECT aligned to 512 bytes only: the first
    write the kernel refuses (EINVAL: each rank file's last, padded buffer) and all after it go
    through the page cache, and the files still have the reference's bytes."""
    monkeypatch.setattr(outfile, "ALIGN", 512)
    src, plan = _source_and_plan(ckpt)
    assert all((rp.size % outfile.SPAN) and -(-rp.size // 512) * 512 % 4096 for rp in plan.ranks)
    with mounted("ext4-4k", tmp_path / "ext4-4k", size_mb=24) as m:
        fd = os.open(m.path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
        try:
            with pytest.raises(OSError) as refused:
                os.pwrite(fd, memoryview(mmap.mmap(-1, 4096))[:512], 0)
            assert refused.value.errno == errno.EINVAL
        finally:
            os.close(fd)
        write_shards(src, plan, m.path / "out", progress=False)
        same_tree(reference["write"], m.path / "out")


def _source_and_plan(ckpt: Path) -> tuple[Source, Plan]:
    src, manifest = open_source(ckpt)
    return src, make_plan(src, manifest, TP)


def _partial(out: Path) -> dict[str, object]:
    try:
        return json.loads((out / PARTIAL_NAME).read_text())["files"]
    except (OSError, ValueError):
        return {}


def test_write_kept_file_must_match_its_record(tmp_path: Path, ckpt: Path, reference: dict[str, Path]) -> None:
    """A published rank file whose bytes no longer match the recorded sha256 is rewritten, not kept."""
    out = tmp_path / "out"
    assert reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress").returncode == 0
    data = bytearray((out / RANK1).read_bytes())
    data[-1] ^= 0xFF
    (out / RANK1).write_bytes(data)
    r = reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress")
    assert "rank 0 kept, rank 1 written" in r.stdout, r.stdout
    same_tree(reference["write"], out)


@pytest.mark.parametrize("existing", [False, True], ids=["new-dir", "existing-dir"])
def test_write_read_only(fs: Mount, ckpt: Path, reference: dict[str, Path], existing: bool) -> None:
    out = fs.path / "out"
    if existing:
        out.mkdir()
    with fs.readonly():
        assert_clean(reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress"),
                     str(out), "read-only file system", "remount it read-write or write elsewhere")
    assert leftovers(fs.path) == [] and (not out.exists() or listing(out) == [])
    r = reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    same_tree(reference["write"], out)


def test_merge_without_room_then_resumed(fs: Mount, reference: dict[str, Path]) -> None:
    out = fs.path / "merged"
    fs.fill(leave=1 << 20)
    assert_clean(reshard("merge", reference["write"], "-o", out, "--no-progress"), f"MB in {out}", "MB free",
                 "run the same merge again")
    assert leftovers(out) == [] and listing(out) == []
    fs.unfill()
    r = reshard("merge", reference["write"], "-o", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    same_tree(reference["merge"], out)


def test_merge_read_only(fs: Mount, reference: dict[str, Path]) -> None:
    out = fs.path / "merged"
    with fs.readonly():
        assert_clean(reshard("merge", reference["write"], "-o", out, "--no-progress"), "read-only file system")
    assert not out.exists()
    assert reshard("merge", reference["write"], "-o", out, "--no-progress").returncode == 0
    same_tree(reference["merge"], out)


@pytest.mark.parametrize("command", ["write", "merge"])
def test_out_is_a_file_or_under_one(tmp_path: Path, ckpt: Path, reference: dict[str, Path], command: str) -> None:
    afile = tmp_path / "afile"
    afile.write_bytes(b"keep me")
    argv = ["write", ckpt, "--tp", TP] if command == "write" else ["merge", reference["write"]]
    assert_clean(reshard(*argv, "-o", afile, "--no-progress"), f"{afile}: exists and is not a directory")
    assert_clean(reshard(*argv, "-o", afile / "sub", "--no-progress"),
                 f"{afile / 'sub'}: {afile} is a file, not a directory")
    assert afile.read_bytes() == b"keep me" and leftovers(tmp_path) == []
    r = reshard("--debug", *argv, "-o", afile, "--no-progress")
    assert r.returncode == 1 and "Traceback" in r.stderr and "OutputPathError" in r.stderr


def test_refused_write_changes_nothing(fs: Mount, ckpt: Path) -> None:
    """Refused before the first byte: the directory, with an earlier run's reshard.json, stays as it was."""
    out = fs.path / "out"  # an earlier run of the same layout wrote rank 0 (another layout is refused before space)
    assert reshard("write", ckpt, "--tp", TP, "--ranks", 0, "-o", out, "--no-progress").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "reshard.json" in before
    fs.fill(leave=1 << 20)
    assert_clean(reshard("write", ckpt, "--tp", TP, "-o", out, "--no-progress"), "needs")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

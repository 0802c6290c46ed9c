"""Small real file systems for output-fault tests: a loop-mounted ext4 image and a tmpfs, each of which
can be filled (a ballast file), freed, and remounted read-only; for the writer's O_DIRECT fallbacks
also a ramfs (no O_DIRECT, no size) and an ext4 on a loop device of 4096-byte sectors (`ext4-4k`). Mounting needs root; where it is not
permitted the tests that need it skip with the reason.

    m = Mount.create("ext4", where, size_mb=16)    # raises MountError (-> skip) when not permitted
    m.fill(leave=1 << 20)                          # ballast: 1 MiB stays free
    m.unfill()                                     # space freed again
    with m.readonly(): ...                         # remount ro, then rw again
    m.destroy()                                    # unmount (and delete the image)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reshard.format.rank_file import rank_file_name

BALLAST = ".ballast"


class MountError(Exception):
    """Mounting is not permitted here (the reason is the message)."""


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise MountError(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")


class Mount:
    def __init__(self, kind: str, path: Path, image: Path | None) -> None:
        self.kind, self.path, self.image = kind, path, image
        self.keep: set[str] = set()  # top-level entries `clean()` leaves (fixtures of a wider scope)

    @classmethod
    def create(cls, kind: str, where: Path, *, size_mb: int) -> Mount:
        if os.geteuid() != 0:
            raise MountError(f"mounting a {kind} needs root (euid {os.geteuid()})")
        where.mkdir(parents=True, exist_ok=True)
        image = None
        if kind == "tmpfs":
            _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where))
        elif kind == "ramfs":  # no size, no O_DIRECT
            _run("mount", "-t", "ramfs", "ramfs", str(where))
        elif kind in ("ext4", "ext4-4k"):  # ext4-4k: on a loop device of 4096-byte logical sectors
            if shutil.which("mkfs.ext4") is None:
                raise MountError("mkfs.ext4 is not installed")
            image = where.with_name(where.name + ".img")
            with open(image, "wb") as f:
                f.truncate(size_mb << 20)
            if kind == "ext4":
                _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
                _run("mount", "-o", "loop", str(image), str(where))
            else:
                r = subprocess.run(["losetup", "-f", "--show", "-b", "4096", str(image)], capture_output=True,
                                   text=True, check=False)
                if r.returncode != 0:
                    raise MountError(f"losetup failed: {r.stderr.strip()}")
                device = r.stdout.strip()
                try:
                    _run("mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", device)
                    _run("mount", device, str(where))
                except MountError:
                    subprocess.run(["losetup", "-d", device], capture_output=True, check=False)
                    raise
        else:
            raise ValueError(kind)
        return cls(kind, where, image)

    def destroy(self) -> None:
        with contextlib.suppress(MountError):
            self.set_readonly(False)
        r = subprocess.run(["umount", str(self.path)], capture_output=True, check=False)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        if self.kind == "ext4-4k" and self.image is not None:  # its loop device (plain `-o loop` frees its own)
            r = subprocess.run(["losetup", "-j", str(self.image)], capture_output=True, text=True, check=False)
            for line in r.stdout.splitlines():
                subprocess.run(["losetup", "-d", line.split(":", 1)[0]], capture_output=True, check=False)
        if self.image is not None:
            self.image.unlink(missing_ok=True)

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, *, leave: int = 0) -> None:
        """A ballast file takes all free space but `leave` bytes (0: every last block)."""
        ballast = self.path / BALLAST
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            want = self.free() - leave
            while want > 0:
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, want)
                    break
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    want -= max(want // 20, 64 << 10)
            if leave == 0:  # the last blocks fallocate could not take
                block = bytes(4096)
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)

    def unfill(self) -> None:
        (self.path / BALLAST).unlink(missing_ok=True)

    def set_readonly(self, ro: bool) -> None:
        _run("mount", "-o", f"remount,{'ro' if ro else 'rw'}", str(self.path))

    @contextlib.contextmanager
    def readonly(self) -> Iterator[None]:
        self.set_readonly(True)
        try:
            yield
        finally:
            self.set_readonly(False)

    def clean(self) -> None:
        """Writable, no ballast, nothing but the `keep` entries."""
        self.set_readonly(False)
        self.unfill()
        for p in self.path.iterdir():
            if p.name in self.keep or p.name == "lost+found":
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


@contextlib.contextmanager
def mounted(kind: str, where: Path, *, size_mb: int) -> Iterator[Mount]:
    """A fresh file system of `kind` at `where` for the block (the test is skipped where mounting is not
    permitted), destroyed after it."""
    try:
        m = Mount.create(kind, where, size_mb=size_mb)
    except MountError as e:
        pytest.skip(f"cannot mount a {kind} here: {e}")
    try:
        yield m
    finally:
        m.destroy()


def leftovers(directory: Path) -> list[str]:
    """Temp files a writer left behind (rank-file, upload and JSON temps)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.rglob("*") if p.name.startswith((".tmp-", ".upload-")))


def listing(directory: Path) -> list[str]:
    """The visible files of a directory (hidden ones are temps and records)."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))


def same_tree(a: Path, b: Path, *, names: list[str] | None = None) -> None:
    """`b` holds the files of `a` (or just `names`) with the same bytes; reshard.json compared as JSON
    (and both hold exactly the same visible files unless `names` is given)."""
    files = names if names is not None else listing(a)
    assert files, a
    if names is None:
        assert listing(b) == files
    for name in files:
        if name == "reshard.json":
            assert json.loads((a / name).read_text()) == json.loads((b / name).read_text())
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


KINDS = ("ext4", "tmpfs")
TP = 2
RANK0, RANK1 = rank_file_name(0, TP), rank_file_name(1, TP)


def get_mount(mounts: dict[str, Mount | str], kind: str) -> Mount:
    m = mounts[kind]
    if isinstance(m, str):
        pytest.skip(f"cannot mount {kind} here: {m}")
    return m


def reshard(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`reshard ARGS` in a fresh interpreter (so a signal would show as a negative return code)."""
    return subprocess.run([sys.executable, "-m", "reshard.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, check=False)


def assert_clean(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit status 1 (not a signal), one `reshard: error:` line naming each needle, no traceback (retries
    announced as they happen, `reshard: warning:` lines, may come before it)."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("reshard: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("reshard: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]

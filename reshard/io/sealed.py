"""Files a process keeps for others to read later (the store cache's blocks, the service's copies of
gathered pieces), sealed with their own checksum and checked before their bytes are trusted.

A sealed file is its data, then `TRAILER` bytes: a magic and the sha256 of the data, written by the
writer that hashed the bytes as it wrote them (`Sealer`). `open_sealed` opens one without following a
symlink (a block replaced by a link to a file outside the cache is refused, not read) and checks it
once per version of the file in this process: by its identity (device, inode, size, mtime and ctime in
nanoseconds; readers that mark a file used set its atime at most once a minute, `touch_used`). A file
overwritten in place changes its mtime and ctime, so it is hashed again; one that does not match its seal (or has none, or is not a regular file) is deleted
and reported missing, so its owner fetches or gathers it again. A 8 MiB block costs a ~6 ms hash the
first time a process opens it, nothing after.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
import time

from cachetools import LRUCache

__all__ = ["TRAILER", "Sealer", "open_sealed", "seal_fd", "touch_used"]

MAGIC = b"RSHDSEAL"
TRAILER = len(MAGIC) + 32
_CHECKED: LRUCache[tuple[int, ...], bool] = LRUCache(1 << 16)  # identities of files found sealed and whole
_LOCK = threading.Lock()


class Sealer:
    """The seal of the bytes fed to it, in order: `update(piece)` as they are written, then `trailer()`."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()

    def update(self, piece: bytes | memoryview) -> None:
        self._sha.update(piece)

    def trailer(self) -> bytes:
        return MAGIC + self._sha.digest()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def open_sealed(path: str | os.PathLike[str], size: int | None = None) -> int | None:
    """`path` open read-only (an fd) if it is a regular file (no symlink followed) of `size` data bytes
    (when given) whose seal matches its data; else None, the file deleted when it was there but broken."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # absent, or a symlink (ELOOP)
        if os.path.islink(path):
            with contextlib.suppress(OSError):
                os.unlink(path)
        return None
    try:
        st = os.fstat(fd)
        ident = _identity(st)
        with _LOCK:
            known = ident in _CHECKED
        whole = stat.S_ISREG(st.st_mode) and st.st_size >= TRAILER and (size is None or st.st_size == size + TRAILER)
        if whole and not known:
            whole = _matches(fd, st.st_size - TRAILER)
            if whole:
                with _LOCK:
                    _CHECKED[ident] = True
    except OSError:
        whole = False
    if not whole:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    return fd


def _matches(fd: int, n: int) -> bool:
    try:
        return os.pread(fd, TRAILER, n) == _seal_of(fd, n)
    except EOFError:
        return False


def _seal_of(fd: int, n: int) -> bytes:
    """The seal of bytes [0, n) of the file open on `fd`, read in 8 MiB blocks; EOFError if it is shorter."""
    sealer, buf, at = Sealer(), bytearray(min(n, 8 << 20) or 1), 0
    view = memoryview(buf)
    while at < n:
        got = os.preadv(fd, [view[: min(len(buf), n - at)]], at)
        if got <= 0:
            raise EOFError(f"the file ended at byte {at} of {n}")
        sealer.update(view[:got])
        at += got
    return sealer.trailer()


def touch_used(fd: int, *, every: float = 60.0) -> None:
    """Mark the file open on `fd` used now (its atime: the LRU clock of the caches that keep sealed files),
    unless it was within `every` seconds: a touch changes the ctime, so the file is checked again."""
    with contextlib.suppress(OSError):
        st = os.fstat(fd)
        if time.time() - st.st_atime > every:
            os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))


def seal_fd(fd: int, n: int) -> None:
    """Append the seal of bytes [0, n) of the file open (read-write) on `fd`, for a file written out of
    order: its bytes read back once."""
    try:
        os.pwrite(fd, _seal_of(fd, n), n)
    except EOFError as e:
        raise OSError(f"{e} while it was sealed") from None

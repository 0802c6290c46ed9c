"""Copies of the gathered pieces of shards pulled more than once, sent by `sendfile` like source ranges.

A row-split tensor's slice is gathered by Python from strided runs of its source file on every pull:
a copy nginx serving a pre-written rank file never makes, plus the copy into the socket (a row-split
rank goes out at 0.6-0.8x nginx on the benchmark's two cores). A storage node serves each rank to
several workers (the data-parallel replicas of a TP group, restarts), so once a shard has been pulled
whole twice, its gathered pieces (`RankStream.gathered`: strided or interleaved pieces of local source
files, each at least `DIRECT_MIN` bytes) are kept in one file, and every later pull of the shard,
whole or a range, by any worker, sends them from that file with `sendfile`.

- A copy holds the pieces in order from byte `LEAD` on, then an index (piece number, offset) and its
  length, checked against the stream's pieces whenever the copy is opened: one file, renamed into
  place whole, that needs no planning to use. It ends with the sha256 of its bytes
  (`reshard.io.sealed`), checked once per version of the file per process: a copy changed in place
  or replaced by a symlink is deleted and written again by the next whole pull, never sent.
- Key: the shard's ETag (the plan digest, which covers the sources' size and mtime, the manifest and
  tp; and the rank), so a changed source never meets an old copy. The stream still checks its
  sources after every range, as for any pull.
- Admission: the first whole pull leaves an empty marker; a whole pull that finds it writes the copy
  as it reads (`pwrite` in the reader thread), under a temporary name that is renamed only once every
  byte has been written from sources that did not change: a partial copy is never used. One pull
  at a time writes a shard's copy (it holds an `flock` on the marker; concurrent pulls of it just
  gather), so a start-up storm of workers writes each copy once. A shard
  pulled once costs a marker; one with nothing to copy gets a `.none` marker and is not looked at
  again (markers are swept after `STALE`).
- Temporary copies are named `NAME.PID-START.tmp` (`reshard.io.owners.owner_tag`): one that a killed
  worker left is removed by the next worker to start (the supervisor's replacement, a restart) and at
  every sweep, and its flock died with it, so the next whole pull writes that shard's copy. Copies
  being written count against the cap.
- Bounded: at most `gather_cache` bytes (`RESHARD_GATHER_CACHE`, `--gather-cache`; 0 turns copies
  off) in ROOT/.reshard/gathered (`RESHARD_GATHER_DIR`), shared by the workers; past it the least
  recently used copies are deleted (a stream that has one open keeps reading it). A full disk or a
  directory that cannot be written stops copies from being written (logged once); it never fails a
  pull.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import re
import struct
import threading
import time
from array import array
from pathlib import Path

from reshard.io.outfs import delete_oldest
from reshard.io.owners import TAG, owner_gone, owner_tag
from reshard.io.rank_stream import RankStream
from reshard.io.sealed import TRAILER, open_sealed, seal_fd, touch_used
from reshard.io.sinks.outfile import pwrite_all

log = logging.getLogger("reshard.service")

STALE = 3600.0  # seconds: markers and orphaned temporary files older than this are deleted
# where a copy's first piece starts: off a page boundary, as the pieces of a source file usually are
# (its header's length); on loopback, sendfile of page-aligned ranges measured 10-20% slower
# (73-79 ms for 200 MiB from offsets 8 to 4000, 83-95 ms from 0 and 4096; a throwaway script)
LEAD = 2048
_TMP = re.compile(rf"^(.+?)(?:\.({TAG}))?\.tmp$")  # NAME.PID-START.tmp (without the owner: an older version's)


class GatherCache:
    """The copies in one directory (`create` gives None where they are off or cannot be kept)."""

    def __init__(self, directory: Path, max_bytes: int, min_piece: int) -> None:
        self.dir, self.max_bytes, self.min_piece = directory, max_bytes, min_piece
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def create(cls, directory: Path, max_bytes: int, min_piece: int) -> GatherCache | None:
        if max_bytes <= 0:
            return None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            log.warning("gathered pieces are not kept (%s: %s): every pull gathers them",
                        directory, e.strerror or e)
            return None
        cache = cls(directory, max_bytes, min_piece)
        cache.sweep()  # what killed workers left, and a cache left larger than this cap
        return cache

    def attach(self, stream: RankStream, etag: str, *, whole: bool) -> Copy | Copier | None:
        """Call in the thread that opened `stream`: the copy of its gathered pieces if there is one (a
        `Copy`, the `PieceCopies` to walk the stream's `runs` with; close it with the stream), or a
        `Copier` that writes the copy while a whole body is read (`feed` every read run, `close` with
        the stream); else None."""
        name = etag.strip('"')
        path = self.dir / f"{name}.bin"
        existed = os.path.lexists(path)
        sealed = open_sealed(path)  # a copy changed in place, or a symlink: deleted, and this pull replaces it
        fd = sealed if sealed is not None else -1
        if fd >= 0:
            try:
                copies = _read_index(fd, stream)
            except (OSError, ValueError, IndexError, struct.error):  # struct.error: shorter than an index
                copies = None
            if copies is not None:
                touch_used(fd)  # most recently used: its atime (the mtime dates its bytes)
                return Copy(fd, copies)
            os.close(fd)  # damaged, or not a copy this code wrote: this pull replaces it
        if not whole or (self.dir / f"{name}.none").exists():
            return None
        marker = self.dir / f"{name}.seen"
        if not existed and not marker.exists():
            with contextlib.suppress(OSError):
                marker.touch()
            return None
        try:
            return Copier(self, name, stream)
        except FileExistsError:  # another pull is writing this copy
            return None
        except OSError as e:
            self.failed(e)
            return None

    def failed(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("a copy of gathered pieces could not be written in %s: %s", self.dir, e.strerror or e)

    def published(self, name: str) -> None:
        """A copy was renamed into place: drop its marker and the least recently used copies past the cap."""
        with contextlib.suppress(OSError):
            (self.dir / f"{name}.seen").unlink()
        self.sweep()

    def sweep(self) -> None:
        """Remove the temporary copies whose writer is gone and the markers older than `STALE`, then the
        least recently used copies past the cap (less the copies being written)."""
        with self._lock:
            now, copies, writing, dead = time.time(), [], 0, 0
            for entry in os.scandir(self.dir):
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    if entry.name.endswith(".bin"):
                        copies.append((st.st_atime, st.st_size, entry.path))
                    elif m := _TMP.match(entry.name):
                        if owner_gone(Path(entry.path), m.group(2), ownerless_age=STALE):
                            os.unlink(entry.path)
                            dead += 1
                        else:
                            writing += st.st_size
                    elif now - st.st_mtime > STALE:  # markers of shards pulled once
                        os.unlink(entry.path)
            delete_oldest(copies, max(self.max_bytes - writing, 0))
        if dead:
            log.warning("removed %d temporary copies of gathered pieces that killed workers left in %s", dead, self.dir)


class Copy:
    """An open copy a stream's `runs` send its gathered pieces from (`reshard.io.rank_stream.PieceCopies`)."""

    def __init__(self, fd: int, at: dict[int, int]) -> None:
        """`at`: piece number -> offset of its bytes in the copy (the copy's index)."""
        self.fd = fd
        self.pieces = {i: (fd, offset) for i, offset in at.items()}

    def copy_of(self, piece: int) -> tuple[int, int] | None:
        return self.pieces.get(piece)

    def feed(self, pos: int, buf: memoryview) -> None:
        pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class Copier:
    """Writes the gathered pieces of a whole body, in order, as the stream reads them; the list of
    them (`RankStream.gathered`, one pass over the plan's pieces) is made at the first read, in the
    reader thread, so the response's status line never waits for it."""

    def __init__(self, cache: GatherCache, name: str, stream: RankStream) -> None:
        self.cache, self.name, self.stream = cache, name, stream
        self.claim = _claim(cache.dir / f"{name}.seen")  # one writer per shard at a time, in any worker
        self.tmp = cache.dir / f"{name}.{owner_tag()}.tmp"
        try:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        except OSError:
            os.close(self.claim)
            raise
        # per piece: (its number, start in the body, length, offset in the copy)
        self._pieces: list[tuple[int, int, int, int]] | None = None
        self._next = self.written = self.total = 0
        self.published = False

    def _plan(self) -> list[tuple[int, int, int, int]]:
        layout = self.stream.gathered(self.cache.min_piece)
        self.total = sum(n for _, _, n in layout)
        if not layout or LEAD + self.total + 16 * len(layout) + 8 > self.cache.max_bytes:
            with contextlib.suppress(OSError):  # nothing to copy (within the cap): later pulls need not look
                (self.cache.dir / f"{self.name}.none").touch()
            self.close()
            return []
        offsets = itertools.accumulate((n for _, _, n in layout), initial=LEAD)  # in order, from LEAD on
        return [(i, start, n, at) for (i, start, n), at in zip(layout, offsets)]

    def feed(self, pos: int, buf: memoryview) -> None:
        """Bytes [pos, pos + len(buf)) of the body (read runs come in order; the pieces are all in them)."""
        if self.fd < 0:
            return
        if self._pieces is None:
            self._pieces = self._plan()
        end = pos + len(buf)
        try:
            while self._next < len(self._pieces):
                _, start, n, at = self._pieces[self._next]
                if start >= end:
                    break
                lo, hi = max(start, pos), min(start + n, end)
                if lo < hi:
                    self.written += pwrite_all(self.fd, buf[lo - pos : hi - pos], at + lo - start)
                if start + n > end:
                    break
                self._next += 1
            if self._pieces and self.written == self.total:
                index = array("q", [x for i, _, _, at in self._pieces for x in (i, at)])
                tail = index.tobytes() + struct.pack("<q", len(self._pieces))
                pwrite_all(self.fd, tail, LEAD + self.total)
                seal_fd(self.fd, LEAD + self.total + len(tail))
                fd, self.fd = self.fd, -1
                os.close(fd)
                os.rename(self.tmp, self.cache.dir / f"{self.name}.bin")
                self.published = True
                self.cache.published(self.name)
        except OSError as e:  # a full disk, say: this pull goes on without its copy
            self.cache.failed(e)
            self.close()

    def close(self) -> None:
        """Drop what was written unless it was published; let the next pull write the shard's copy."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        if not self.published:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
        claim, self.claim = self.claim, -1
        if claim >= 0:
            os.close(claim)  # releases the flock


def _claim(marker: Path) -> int:
    """An open file of `marker` holding an exclusive flock on it (released when closed, or when the
    holder dies); FileExistsError where another pull holds it."""
    fd = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FileExistsError(f"{marker}: another pull writes this copy") from None
    except OSError:
        os.close(fd)
        raise
    return fd


def _read_index(fd: int, stream: RankStream) -> dict[int, int]:
    """The copy's index (piece number -> offset in the copy), from its last bytes: the pieces, then
    (number, offset) pairs as int64, then their count; checked against the file's size and the
    stream's pieces (each piece's bytes end where the next one's begin)."""
    size = os.fstat(fd).st_size - TRAILER  # its data, before the seal
    (count,) = struct.unpack("<q", os.pread(fd, 8, size - 8))
    if not 0 < count <= (size - LEAD) // 24:
        raise ValueError("not a copy")
    index = array("q")
    index.frombytes(os.pread(fd, 16 * count, size - 8 - 16 * count))
    at = LEAD
    for i, offset in zip(index[::2], index[1::2]):
        if offset != at:
            raise ValueError("not a copy of this stream's pieces")
        at += stream.piece_bytes(i)
    if at != size - 8 - 16 * count:
        raise ValueError("not a copy of this stream's pieces")
    return dict(zip(index[::2], index[1::2]))

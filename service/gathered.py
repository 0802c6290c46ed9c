"""Copies of the gathered pieces of shards pulled more than once, sent by `sendfile` like source ranges.

A row-split tensor's slice is gathered by Python from strided runs of its source file on every pull:
a copy nginx serving a pre-written rank file never makes, plus the copy into the socket (a row-split
rank goes out at 0.6-0.8x nginx on the benchmark's two cores). A storage node serves each rank to
several workers (the data-parallel replicas of a TP group, restarts), so once a shard has been pulled
whole twice, its gathered pieces (`RankStream.gathered`: strided or interleaved pieces of local source
files, each at least `DIRECT_MIN` bytes) are kept, in order, in one file (from byte `LEAD` on), and every later pull of
the shard, whole or a range, by any worker, sends them from that file with `sendfile`.

- Key: the shard's ETag (the plan digest, which covers the sources' size and mtime, the manifest and
  tp; and the rank), so a changed source never meets an old copy. The stream still checks its
  sources after every range, as for any pull.
- Admission: the first whole pull leaves an empty marker; a whole pull that finds it writes the copy
  as it reads (`pwrite` in the reader thread), under a temporary name that is renamed only once every
  byte has been written from sources that did not change: a partial copy is never used. A shard
  pulled once costs a marker.
- Bounded: at most `gather_cache` bytes (`RESHARD_GATHER_CACHE`, `--gather-cache`; 0 turns copies off)
  in ROOT/.reshard/gathered (`RESHARD_GATHER_DIR`), shared by the workers; past it the least recently used copies are deleted (a stream
  that has one open keeps reading it). A full disk or a directory that cannot be written stops copies
  from being written (logged once); it never fails a pull.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path

from reshard.stream import RankStream
from service.catalog import LRU

log = logging.getLogger("reshard.service")

STALE = 3600.0  # seconds: markers and orphaned temporary files older than this are deleted
# where a copy's first piece starts: off a page boundary, as the pieces of a source file usually are
# (its header's length); on loopback, sendfile of page-aligned ranges measured 10-20% slower
# (73-79 ms for 200 MiB from offsets 8 to 4000, 83-95 ms from 0 and 4096; a throwaway script)
LEAD = 2048
_SEQ = itertools.count()


class GatherCache:
    """The copies in one directory (`create` gives None where they are off or cannot be kept)."""

    def __init__(self, directory: Path, max_bytes: int, min_piece: int) -> None:
        self.dir, self.max_bytes, self.min_piece = directory, max_bytes, min_piece
        self._layouts: LRU[str, list[tuple[int, int, int]]] = LRU(256)  # ETag -> gathered pieces
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
        return cls(directory, max_bytes, min_piece)

    def attach(self, stream: RankStream, etag: str, *, whole: bool) -> Copy | Copier | None:
        """Call in the thread that opened `stream`: its gathered pieces now come from their copy if
        there is one (a `Copy` to close with the stream), or a `Copier` that writes the copy while a
        whole body is read (`feed` every read run, `close` with the stream); else None."""
        name = etag.strip('"')
        path = self.dir / f"{name}.bin"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            fd = -1
        if fd >= 0:
            layout = self._layout(name, stream)
            if os.fstat(fd).st_size == LEAD + sum(n for _, _, n in layout):
                with contextlib.suppress(OSError):
                    os.utime(path)  # most recently used
                offsets = itertools.accumulate((n for _, _, n in layout), initial=LEAD)
                stream.use_copies({i: (fd, at) for (i, _, _), at in zip(layout, offsets)})
                return Copy(fd)
            os.close(fd)  # not this layout (written under other settings): replace it
        if not whole:
            return None
        marker = self.dir / f"{name}.seen"
        if not marker.exists():
            with contextlib.suppress(OSError):
                marker.touch()
            return None
        layout = self._layout(name, stream)
        total = sum(n for _, _, n in layout)
        if not layout or LEAD + total > self.max_bytes:
            return None
        try:
            return Copier(self, name, layout, total)
        except OSError as e:
            self.failed(e)
            return None

    def _layout(self, name: str, stream: RankStream) -> list[tuple[int, int, int]]:
        layout = self._layouts.get(name)
        if layout is None:
            layout = stream.gathered(self.min_piece)
            self._layouts.put(name, layout)
        return layout

    def failed(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("a copy of gathered pieces could not be written in %s: %s", self.dir, e.strerror or e)

    def published(self, name: str) -> None:
        """A copy was renamed into place: drop its marker and the least recently used copies past the cap."""
        with contextlib.suppress(OSError):
            (self.dir / f"{name}.seen").unlink()
        with self._lock:
            now, copies = time.time(), []
            for entry in os.scandir(self.dir):
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    if entry.name.endswith(".bin"):
                        copies.append((st.st_mtime, st.st_size, entry.path))
                    elif now - st.st_mtime > STALE:  # markers of shards pulled once, temporaries of dead workers
                        os.unlink(entry.path)
            total = sum(size for _, size, _ in copies)
            for _, size, path in sorted(copies):
                if total <= self.max_bytes:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    total -= size


class Copy:
    """An open copy a stream reads its gathered pieces from."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def feed(self, pos: int, buf: memoryview) -> None:
        pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class Copier:
    """Writes the gathered pieces of a whole body, in order, as the stream reads them."""

    def __init__(self, cache: GatherCache, name: str, layout: list[tuple[int, int, int]], total: int) -> None:
        self.cache, self.name, self.total, self.written = cache, name, total, 0
        self.tmp = cache.dir / f"{name}.{os.getpid()}-{next(_SEQ)}.tmp"
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        offsets = itertools.accumulate((n for _, _, n in layout), initial=LEAD)
        self._pieces = [(start, n, at) for (_, start, n), at in zip(layout, offsets)]
        self._next = 0
        self.published = False

    def feed(self, pos: int, buf: memoryview) -> None:
        """Bytes [pos, pos + len(buf)) of the body (read runs come in order; the pieces are all in them)."""
        if self.fd < 0:
            return
        end = pos + len(buf)
        try:
            while self._next < len(self._pieces):
                start, n, at = self._pieces[self._next]
                if start >= end:
                    break
                lo, hi = max(start, pos), min(start + n, end)
                while lo < hi:
                    k = os.pwrite(self.fd, buf[lo - pos : hi - pos], at + lo - start)
                    self.written += k
                    lo += k
                if start + n > end:
                    break
                self._next += 1
            if self.written == self.total:
                fd, self.fd = self.fd, -1
                os.close(fd)
                os.rename(self.tmp, self.cache.dir / f"{self.name}.bin")
                self.published = True
                self.cache.published(self.name)
        except OSError as e:  # a full disk, say: this pull goes on without its copy
            self.cache.failed(e)
            self.close()

    def close(self) -> None:
        """Drop what was written unless it was published."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        if not self.published:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)

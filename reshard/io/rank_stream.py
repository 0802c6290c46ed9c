"""RankPlan -> bytes: the rank file's header then its tensors, in bounded chunks, from any byte offset.

Every sink (file writer, HTTP response, trainer fill) consumes this one stream, so they all see the
same bytes. Memory is one chunk (plus a bounded scratch for gathering small strided runs: what is read
for each piece is listed by `reshard.plan.reads`, the one definition the plan's `bytes_read` sums). Source
files are opened once through a reader (`reshard.io.source.readers`: pread on a local fd, or ranged GETs
from a store, fetched ahead by a `Prefetcher` within a fixed cap) and checked against the plan's
identity at open and after every read: a file that changes under the stream fails it
(`SourceChangedError`) rather than yield mixed bytes.

A sink that can have the kernel copy file ranges walks `runs` instead of reading chunks (and says
what it has sent with `done`); one that keeps whole copies of the pieces the stream gathers
(`gathered`) hands them to `runs` as `PieceCopies`, so they go out as ranges of the copies too. The
stream knows no sink: it asks only that interface, and by default there are no copies.
"""

from __future__ import annotations

import bisect
import functools
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from reshard.io.source.cached_object import BytesAt, CachedObject
from reshard.io.source.readers import Reader, RemoteReader, open_reader
from reshard.io.source.stores import is_url
from reshard.plan.planned import piece_index
from reshard.plan.reads import SCRATCH, Interleave, Segment, piece_reads, runs_array
from reshard.plan.types import RankPlan

if TYPE_CHECKING:
    from reshard.io.source.prefetch import Prefetcher

CHUNK = 8 << 20


class PieceCopies(Protocol):
    """Whole copies of some of a stream's pieces (by piece number, see `RankStream.gathered`) in files
    a sink keeps open while it walks `RankStream.runs`: a copied piece goes out as a range of its copy."""

    def copy_of(self, piece: int) -> tuple[int, int] | None:
        """(fd, offset) of the file range that holds piece `piece`'s bytes, or None (no copy of it)."""


class NoCopies:
    """No piece has a copy (the default of `RankStream.runs`)."""

    def copy_of(self, piece: int) -> None:
        return None


NO_COPIES = NoCopies()


class RankStream:
    """The bytes of one rank file. Use as a context manager, or call `close()`."""

    def __init__(self, plan: RankPlan, *, chunk_size: int = CHUNK) -> None:
        self.plan = plan
        self.size = plan.size
        self.chunk_size = chunk_size
        self._readers: dict[str, Reader] = {}
        self._scratch: bytearray | None = None
        # where each piece starts in the output, and the pieces (bytes, Segment or Interleave)
        starts, pieces = piece_index(plan)
        self._starts, self._pieces = starts, pieces
        self._pinned: deque[tuple[int, CachedObject, tuple[int, int]]] = deque()  # (end, blocks, source) not sent yet
        self._prefetch: Prefetcher | None = None
        try:
            if any(is_url(path) for path in plan.files):  # only a store's stream fetches ahead (and reads the store settings)
                from reshard.io.source.prefetch import Prefetcher

                self._prefetch = Prefetcher(starts, pieces, self.size)
            for path, key in plan.files.items():  # its remote readers are built with it
                self._readers[path] = open_reader(path, key, fetch_ahead=self._prefetch)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RankStream:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        readers, self._readers = self._readers, {}
        if getattr(self, "_prefetch", None) is not None:
            self._prefetch.cancel()
        for r in readers.values():
            r.close()

    def chunks(self, start: int = 0, end: int | None = None, *, reuse: bool = False) -> Iterator[memoryview]:
        """Yield bytes [start, end) in chunks of at most `chunk_size`.

        With `reuse`, every chunk is a view of one buffer that the next chunk overwrites (for sinks
        that consume a chunk before asking for the next); otherwise each chunk owns its memory.
        """
        end = self.size if end is None else end
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"byte range [{start}, {end}) outside 0..{self.size}")
        buf = bytearray(min(self.chunk_size, max(end - start, 1))) if reuse else None
        pos = start
        while pos < end:
            n = min(self.chunk_size, end - pos)
            out = memoryview(buf)[:n] if buf is not None else memoryview(bytearray(n))
            self.read_into(pos, out)
            pos += n
            yield out

    def runs(self, start: int = 0, end: int | None = None, *, chunk_size: int, direct_min: int,
             copies: PieceCopies = NO_COPIES) -> Iterator[tuple[int, int, BytesAt | None]]:
        """Bytes [start, end) as consecutive runs (output offset, length, source), for sinks that can
        have the kernel copy file ranges (`copy_file_range`, `sendfile`): `source` is (fd, offset) for
        a contiguous range of at least `direct_min` bytes of a local source file, of a piece's copy
        in `copies`, or of a store object's block file in the node's cache (call `done` once it is
        sent; where the block is still on its way, a function that waits for it off the event loop
        and returns (fd, offset), or None: then fill the run with `read_into`); otherwise None, a run
        of at most `chunk_size` bytes to fill with `read_into` (neighbouring small pieces merged).
        Never waits on a store."""
        end = self.size if end is None else end
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"byte range [{start}, {end}) outside 0..{self.size}")
        pending, pos = start, start  # bytes [pending, pos) are still to be yielded as read runs
        i = bisect.bisect_right(self._starts, start) - 1
        copy_of = copies.copy_of
        while pos < end:
            piece, base = self._pieces[i], self._starts[i]
            hi = min(base + _nbytes(piece), end)
            for a, b, src in self._sources(i, pos, hi, direct_min, copy_of):
                if src is not None:
                    while pending < a:
                        n = min(chunk_size, a - pending)
                        yield pending, n, None
                        pending += n
                    yield a, b - a, src
                    pending = b
                while b - pending >= chunk_size:
                    yield pending, chunk_size, None
                    pending += chunk_size
            pos = hi
            i += 1
        if pending < end:
            yield pending, end - pending, None

    def _sources(self, i: int, pos: int, hi: int, direct_min: int, copy_of: Callable[[int], tuple[int, int] | None]
                 ) -> Iterator[tuple[int, int, BytesAt | None]]:
        """Output bytes [pos, hi) of piece i as parts (start, end, source or None) (see `runs`)."""
        piece, base = self._pieces[i], self._starts[i]
        if self._direct(piece):
            yield pos, hi, (self._readers[piece.file].fd, piece.offset + pos - base) if hi - pos >= direct_min else None
            return
        copied = copy_of(i)
        if copied is not None:
            fd, at = copied
            yield pos, hi, (fd, at + pos - base) if hi - pos >= direct_min else None
            return
        reader = self._readers.get(piece.file) if isinstance(piece, Segment) and piece.contiguous else None
        if not isinstance(reader, RemoteReader) or reader.blocks is None or hi - pos < direct_min:
            yield pos, hi, None
            return
        assert self._prefetch is not None
        self._prefetch.ahead(pos, hi)  # the blocks behind the next windows on their way
        for n, src in reader.blocks.ranges(piece.offset + pos - base, hi - pos, direct_min=direct_min):
            if callable(src):
                src = functools.partial(self._pin, pos + n, reader.blocks, src)
            elif src is not None:
                self._pin(pos + n, reader.blocks, src)
            yield pos, pos + n, src
            pos += n

    def _pin(self, end: int, blocks: CachedObject, src: BytesAt) -> tuple[int, int] | None:
        """Keep `src` (or what the wait for it gives) open until the sink is done with byte `end`."""
        got = src() if callable(src) else src
        if got is not None:
            self._pinned.append((end, blocks, got))
        return got

    def done(self, pos: int) -> None:
        """The sink has sent the stream's bytes before `pos`: the block files they came from may be closed."""
        while self._pinned and self._pinned[0][0] <= pos:
            _, blocks, src = self._pinned.popleft()
            blocks.unpin(src)
        if self._prefetch is not None:
            self._prefetch.behind(pos)

    def _direct(self, piece: bytes | Segment | Interleave) -> bool:
        """Whether a kernel copy can take the piece straight from its (local) source file."""
        return (isinstance(piece, Segment) and piece.contiguous and piece.file is not None
                and self._readers[piece.file].fd is not None)

    def gathered(self, min_bytes: int) -> list[tuple[int, int, int]]:
        """(index, output offset, length) of each piece of at least `min_bytes` that is gathered from
        local source files (strided or interleaved), in order: what a sink keeping whole copies of
        them copies, so that `runs` can yield them as ranges of their copies later (`PieceCopies`)."""
        out = []
        for i, piece in enumerate(self._pieces):
            if (isinstance(piece, (Segment, Interleave)) and piece.nbytes >= min_bytes and not self._direct(piece)
                    and all(f is not None and self._readers[f].fd is not None for f in _files(piece))):
                out.append((i, self._starts[i], piece.nbytes))
        return out

    def piece_bytes(self, i: int) -> int:
        """The length of piece `i` (IndexError past the last)."""
        if not 0 <= i < len(self._starts):
            raise IndexError(i)
        return _nbytes(self._pieces[i])

    def read_into(self, pos: int, out: memoryview, *, check: bool = True) -> None:
        """Fill `out` with the stream's bytes starting at `pos`; then, with `check`, raise
        `SourceChangedError` if a source changed (a sink that checks once before it publishes, as the
        writer does, passes False)."""
        if self._prefetch is not None:
            self._prefetch.ensure(pos, pos + len(out))
        i = bisect.bisect_right(self._starts, pos) - 1
        done = 0
        while done < len(out):
            piece, base = self._pieces[i], self._starts[i]
            plen = _nbytes(piece)
            lo = pos + done - base
            n = min(plen - lo, len(out) - done)
            dst = out[done : done + n]
            if isinstance(piece, bytes):
                dst[:] = piece[lo : lo + n]
            elif isinstance(piece, Segment) and piece.file is None:
                dst[:] = bytes(n)
            else:
                self._read_piece(piece, lo, dst)
            done += n
            i += 1
        if check:
            self.check_unchanged()

    def check_unchanged(self) -> None:
        """Raise `SourceChangedError` if a source file changed since the stream opened."""
        for reader in self._readers.values():
            reader.check()

    def _read_piece(self, piece: Segment | Interleave, lo: int, dst: memoryview) -> None:
        """Bytes [lo, lo+len(dst)) of a source piece into dst: the reads `piece_reads` lists; short
        strided runs straight from a leased mapping where the reader has one, else their span
        through the scratch, gathered with numpy."""
        if isinstance(piece, Interleave) and any(p.file is None for p in piece.parts):
            dst[:] = bytes(len(dst))  # a padding part: its columns stay zero
        for rd in piece_reads(piece, lo, lo + len(dst)):
            reader = self._readers[rd.file]
            if rd.count == 1:
                reader.pread(dst[rd.dst : rd.dst + rd.run], rd.offset)
                continue
            out = runs_array(dst, rd.dst, rd.run, rd.step, rd.count)
            if reader.gather(out, rd.offset, rd.run, rd.stride, rd.count):
                continue
            scratch = self._scratch_view(rd.span)
            reader.pread_runs(scratch, rd.offset, rd.run, rd.stride, rd.count)
            out[...] = runs_array(scratch, 0, rd.run, rd.stride, rd.count)

    def _scratch_view(self, n: int) -> memoryview:
        if self._scratch is None or len(self._scratch) < n:
            self._scratch = bytearray(max(n, min(SCRATCH, 1 << 20)))
        return memoryview(self._scratch)[:n]


def _nbytes(piece: bytes | Segment | Interleave) -> int:
    return len(piece) if isinstance(piece, bytes) else piece.nbytes


def _files(piece: Segment | Interleave) -> list[str | None]:
    return [p.file for p in piece.parts if p.file is not None] if isinstance(piece, Interleave) else [piece.file]

"""RankPlan -> bytes: the rank file's header then its tensors, in bounded chunks, from any byte offset.

Every sink (file writer, HTTP response, trainer fill) consumes this one stream, so they all see the
same bytes. Memory is one chunk (plus a bounded scratch for gathering small strided runs). Source
files are opened once through a reader (`reshard.sources.readers`: pread on a local fd, or ranged GETs
from a store, fetched ahead by a `Prefetcher` within a fixed cap) and checked against the plan's
identity at open and after every read: a file that changes under the stream fails it
(`SourceChangedError`) rather than yield mixed bytes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from types import TracebackType

from reshard.plan import Interleave, RankPlan, Segment
from reshard.sources.readers import Prefetcher, Reader, RemoteReader, open_reader

CHUNK = 8 << 20
_DIRECT_RUN = 256 << 10  # runs at least this long are read straight into the output
_SCRATCH = 8 << 20


class RankStream:
    """The bytes of one rank file. Use as a context manager, or call `close()`."""

    def __init__(self, plan: RankPlan, *, chunk_size: int = CHUNK) -> None:
        self.plan = plan
        self.size = plan.size
        self.chunk_size = chunk_size
        self._readers: dict[str, Reader] = {}
        self._scratch: bytearray | None = None
        # flat index of pieces: (start offset in the output, piece); a piece is bytes or a Segment
        starts: list[int] = [0]
        pieces: list[bytes | Segment | Interleave] = [plan.header]
        pos = len(plan.header)
        for t in plan.tensors:
            for seg in t.segments:
                if seg.nbytes:
                    starts.append(pos)
                    pieces.append(seg)
                    pos += seg.nbytes
        assert pos == self.size
        self._starts, self._pieces = starts, pieces
        try:
            for path, key in plan.files.items():
                self._readers[path] = open_reader(path, key)
        except BaseException:
            self.close()
            raise
        remote = {p: r for p, r in self._readers.items() if isinstance(r, RemoteReader)}
        self._prefetch = Prefetcher(starts, pieces, self.size, remote) if remote else None

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

    def spans(self) -> Iterator[tuple[int, int, tuple[int, int] | None]]:
        """(output offset, length, source) for every piece of the file in order; `source` is
        (fd, offset) when the piece is one contiguous range of a source file (a sink may copy it in
        the kernel), else None (read it with `read_into`)."""
        for start, piece in zip(self._starts, self._pieces):
            if isinstance(piece, bytes):
                yield start, len(piece), None
            elif isinstance(piece, Segment) and piece.file is not None and piece.contiguous \
                    and self._readers[piece.file].fd is not None:
                yield start, piece.nbytes, (self._readers[piece.file].fd, piece.offset)
            else:
                yield start, piece.nbytes, None

    def read_into(self, pos: int, out: memoryview) -> None:
        """Fill `out` with the stream's bytes starting at `pos`."""
        if self._prefetch is not None:
            self._prefetch.ensure(pos, pos + len(out))
        i = bisect.bisect_right(self._starts, pos) - 1
        done = 0
        while done < len(out):
            piece, base = self._pieces[i], self._starts[i]
            plen = len(piece) if isinstance(piece, bytes) else piece.nbytes
            lo = pos + done - base
            n = min(plen - lo, len(out) - done)
            dst = out[done : done + n]
            if isinstance(piece, bytes):
                dst[:] = piece[lo : lo + n]
            elif isinstance(piece, Interleave):
                self._read_interleave(piece, lo, dst)
            elif piece.file is None:
                dst[:] = bytes(n)
            else:
                self._read_segment(piece, lo, dst)
            done += n
            i += 1
        self.check_unchanged()

    def check_unchanged(self) -> None:
        """Raise `SourceChangedError` if a source file changed since the stream opened."""
        for reader in self._readers.values():
            reader.check()

    def _read_segment(self, seg: Segment, lo: int, dst: memoryview) -> None:
        """Bytes [lo, lo+len(dst)) of a source segment into dst."""
        assert seg.file is not None
        reader = self._readers[seg.file]
        if seg.contiguous:
            reader.pread(dst, seg.offset + lo)
            return
        run, stride = seg.run, seg.stride
        pos, end = lo, lo + len(dst)
        while pos < end:
            r, within = divmod(pos, run)
            if within or end - pos < run or run >= _DIRECT_RUN:
                n = min(run - within, end - pos)
                reader.pread(dst[pos - lo : pos - lo + n], seg.offset + r * stride + within)
                pos += n
                continue
            # several whole small runs: read the span covering them once, gather with numpy
            import numpy as np  # only strided (row-split) tensors need it
            k = min((end - pos) // run, max(1, (_SCRATCH - run) // stride + 1))
            span = (k - 1) * stride + run
            scratch = self._scratch_view(span)
            reader.pread_runs(scratch, seg.offset + r * stride, run, stride, k)
            src = np.lib.stride_tricks.as_strided(np.frombuffer(scratch, np.uint8), (k, run), (stride, 1))
            np.frombuffer(dst, np.uint8)[pos - lo : pos - lo + k * run].reshape(k, run)[...] = src
            pos += k * run

    def _read_interleave(self, il: Interleave, lo: int, dst: memoryview) -> None:
        """Bytes [lo, lo+len(dst)) of rows made of one run of each part: whole rows are gathered
        part by part into their columns of dst; partial rows at the edges part by part."""
        import numpy as np

        runs = [p.run for p in il.parts]
        row = sum(runs)
        cols = list(itertools.accumulate(runs, initial=0))
        pos, end = lo, lo + len(dst)
        while pos < end:
            r, within = divmod(pos, row)
            if within or end - pos < row:  # a partial row
                stop = min(row, within + end - pos)
                for part, a in zip(il.parts, cols):
                    x, y = max(within, a), min(stop, a + part.run)
                    if x < y:
                        self._read_segment(part, r * part.run + x - a, dst[pos - lo + x - within : pos - lo + y - within])
                pos += stop - within
                continue
            k = min((end - pos) // row, max(1, _SCRATCH // max(max(p.stride, p.run) for p in il.parts)))
            rows = np.frombuffer(dst, np.uint8)[pos - lo : pos - lo + k * row].reshape(k, row)
            for part, a in zip(il.parts, cols):
                span = (k - 1) * part.stride + part.run if k > 1 else part.run
                scratch = self._scratch_view(span)
                self._readers[part.file].pread_runs(scratch, part.offset + r * part.stride, part.run, part.stride, k)
                src = np.lib.stride_tricks.as_strided(np.frombuffer(scratch, np.uint8), (k, part.run), (part.stride, 1))
                rows[:, a : a + part.run] = src
            pos += k * row

    def _scratch_view(self, n: int) -> memoryview:
        if self._scratch is None or len(self._scratch) < n:
            self._scratch = bytearray(max(n, min(_SCRATCH, 1 << 20)))
        return memoryview(self._scratch)[:n]

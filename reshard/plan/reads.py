"""What a rank stream reads from its source files: one definition for every reader of a plan.

The plan describes every piece of a rank file as a `Segment` (strided runs of one source file, or
zero padding) or an `Interleave` (rows put together from several files); a piece is read as a list of `Read`s. A run of at
least `DIRECT_RUN` bytes (or a contiguous segment) is read straight into the output; several whole
shorter runs `stride` apart are read as the one span that covers them (at most `SCRATCH` bytes) and
gathered. The local stream preads exactly these spans, the remote prefetcher fetches them (so a
row-split tensor comes as row blocks, not row by row), and the plan's `bytes_read` is their sum
(`bytes_read`), so the figure `reshard plan` prints is what reading a rank costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

DIRECT_RUN = 256 << 10  # runs at least this long are read straight into the output
SCRATCH = 8 << 20  # the most a gathered span covers


@dataclass(frozen=True)
class Segment:
    """`count` runs of `run` bytes, `stride` apart, starting at `offset` in source file `file`.

    `file` is None for zero padding (then only `run * count` matters).
    """

    file: str | None
    offset: int
    run: int
    count: int = 1
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.run * self.count

    @property
    def contiguous(self) -> bool:
        """Its runs are back to back: one byte range of `file`."""
        return self.count == 1 or self.stride == self.run


@dataclass(frozen=True)
class Interleave:
    """`count` rows, each made of one run of every part in order (the parts share `count`): a
    row-split tensor put together from several rank files."""

    parts: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Extent = Segment | Interleave


@dataclass(frozen=True)
class Read:
    """Bytes [offset, offset + span) of `file`, read at once; its `count` runs of `run` bytes,
    `stride` apart, land at `dst`, `dst + step`, ... of the piece's output bytes."""

    file: str
    offset: int
    run: int
    count: int
    stride: int
    dst: int
    step: int

    @property
    def span(self) -> int:
        return (self.count - 1) * self.stride + self.run if self.count > 1 else self.run


def segment_reads(seg: Segment, lo: int, hi: int, *, at: int = 0, step: int = 0) -> Iterator[Read]:
    """The reads behind bytes [lo, hi) of `seg`; its byte x lands at output byte `at + x - lo`, or,
    with `step`, its run r at `at + r * step` (a part of an interleave: one column of its rows)."""
    if seg.file is None or hi <= lo:
        return
    if seg.contiguous and not step:
        yield Read(seg.file, seg.offset + lo, hi - lo, 1, 0, at, 0)
        return
    run, stride = seg.run, seg.stride if seg.count > 1 else seg.run
    step = step or run
    r0, w0 = divmod(lo, run)
    pos = lo
    while pos < hi:
        r, within = divmod(pos, run)
        out = at + (r - r0) * step + within - w0
        if within or hi - pos < run or run >= DIRECT_RUN:
            n = min(run - within, hi - pos)
            yield Read(seg.file, seg.offset + r * stride + within, n, 1, 0, out, 0)
            pos += n
            continue
        k = min((hi - pos) // run, max(1, (SCRATCH - run) // stride + 1))
        yield Read(seg.file, seg.offset + r * stride, run, k, stride, out, step)
        pos += k * run


def interleave_reads(il: Interleave, lo: int, hi: int) -> Iterator[Read]:
    """The reads behind bytes [lo, hi) of rows made of one run of each part: whole rows part by part
    (a part's runs into its column of the rows), partial rows at the edges part by part."""
    row = il.nbytes // il.parts[0].count
    cols = list(itertools.accumulate((p.run for p in il.parts), initial=0))
    kmax = max(1, SCRATCH // max(max(p.stride, p.run) for p in il.parts))
    pos = lo
    while pos < hi:
        r, within = divmod(pos, row)
        if within or hi - pos < row:  # a partial row
            stop = min(row, within + hi - pos)
            for part, a in zip(il.parts, cols):
                x, y = max(within, a), min(stop, a + part.run)
                if x < y:
                    yield from segment_reads(part, r * part.run + x - a, r * part.run + y - a, at=pos - lo + x - within)
            pos += stop - within
            continue
        k = min((hi - pos) // row, kmax)
        for part, a in zip(il.parts, cols):
            yield from segment_reads(part, r * part.run, (r + k) * part.run, at=pos - lo + a, step=row)
        pos += k * row


def piece_reads(piece: Segment | Interleave, lo: int, hi: int) -> Iterator[Read]:
    """The reads behind bytes [lo, hi) of a stream piece; `dst` is relative to byte `lo`."""
    if isinstance(piece, Segment):
        return segment_reads(piece, lo, hi)
    return interleave_reads(piece, lo, hi)


def bytes_read(piece: Segment | Interleave) -> int:
    """The source bytes a stream reads for the whole piece (the spans of gathered runs included)."""
    return sum(r.span for r in piece_reads(piece, 0, piece.nbytes))


def runs_array(buf: Any, offset: int, run: int, stride: int, count: int) -> np.ndarray:
    """The `count` runs of `run` bytes `stride` apart from `offset` of `buf` (bytes-like or a uint8
    array) as a 1-d numpy array of `run`-byte elements, for one copy (`out[...] = src`) from runs to
    runs: numpy copies a whole element at a time, 1.6-6x faster than through a (count, run) uint8 view
    for runs of up to 64 bytes (small tensors, narrow experts), the same from 256 bytes up
    (`python -m bench.gather`)."""
    import numpy as np  # only strided (row-split) tensors need it

    base = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf
    first = base[offset : offset + run].view(f"V{run}") if count else base[:0].view(f"V{run}")
    return np.lib.stride_tricks.as_strided(first, (count,), (stride,))

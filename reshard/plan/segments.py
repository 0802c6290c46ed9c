"""Where a rank's tensor comes from: a selection of a global tensor -> source byte runs, and the file layout.

`segments_for` turns a selection into the `Segment`s and `Interleave`s that produce it, in row-major
order (pieces of the tensor spread over several files included); `layout` orders a rank's tensors
as safetensors does and builds the exact header.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from reshard.errors import PlanError
from reshard.format.checkpoint import DTYPE_SIZES, GlobalTensor, Piece, encode_header
from reshard.format.selection import Interval, Selection, selection_shape
from reshard.plan.reads import Extent, Interleave, Segment
from reshard.plan.types import OutTensor, RankPlan, data_order


def _refine(intervals: tuple[Interval, ...], cuts: list[int], size: int) -> tuple[Interval, ...]:
    """Split intervals at every cut inside them (padding past `size` stays one interval)."""
    out = []
    for a, b in intervals:
        for c in cuts:
            if a < c < min(b, size):
                out.append((a, c))
                a = c
        out.append((a, b))
    return tuple(out)


class _PieceIndex:
    """Maps global index boxes of a tensor to the piece that holds them and the piece's byte layout."""

    def __init__(self, gt: GlobalTensor) -> None:
        self.gt = gt
        self.item = gt.itemsize
        self.local = []  # per piece: (per dim: [(a, b, local start)], local strides)
        for p in gt.pieces:
            dims = []
            for dim in p.select:
                starts = itertools.accumulate((b - a for a, b in dim), initial=0)
                dims.append([(a, b, s) for (a, b), s in zip(dim, starts)])
            lshape = [sum(b - a for a, b in dim) for dim in p.select]
            strides = [math.prod(lshape[d + 1 :]) * self.item for d in range(len(lshape))]
            self.local.append((dims, strides))

    def cuts(self, d: int) -> list[int]:
        return sorted({x for p in self.gt.pieces for a, b in p.select[d] for x in (a, b)})

    def split_dims(self) -> list[bool]:
        """Dims some piece does not hold whole."""
        shape = self.gt.shape
        return [any(p.select[d] != ((0, shape[d]),) for p in self.gt.pieces) for d in range(len(shape))]

    def locate(self, box: list[Interval]) -> tuple[Piece, int, list[int]]:
        """(piece, byte offset of the box's first element in the piece's file, piece strides)."""
        for piece, (dims, strides) in zip(self.gt.pieces, self.local):
            offset = piece.info.start
            for d, (a, b) in enumerate(box):
                hit = next(((lo, s) for lo, hi, s in dims[d] if lo <= a and b <= hi), None)
                if hit is None:
                    break
                offset += (hit[1] + a - hit[0]) * strides[d]
            else:
                return piece, offset, strides
        raise PlanError(f"{self.gt.name}: no piece holds indices {box}; the rank shards are incomplete")


def segments_for(gt: GlobalTensor, sel: Selection) -> tuple[Extent, ...]:
    """Source byte runs (and zero padding) that produce `sel` of global tensor `gt`, in row-major order."""
    shape = gt.shape
    if not shape:
        p = gt.pieces[0].info
        return (Segment(str(p.file), p.start, p.nbytes),)
    index = _PieceIndex(gt)
    sel = tuple(_refine(sel[d], index.cuts(d), shape[d]) for d in range(len(shape)))
    split = index.split_dims()
    nonfull = [split[d] or sel[d] != ((0, shape[d]),) for d in range(len(shape))]
    k = max((d for d in range(len(shape)) if nonfull[d]), default=-1)
    if k < 0:
        piece, offset, _ = index.locate([(0, n) for n in shape])
        return (Segment(str(piece.info.file), offset, gt.nbytes),)
    inner_bytes = math.prod(shape[k + 1 :]) * gt.itemsize
    tail = [(0, n) for n in shape[k + 1 :]]
    out: list[Extent] = []

    def emit(seg: Extent) -> None:
        last = out[-1] if out else None
        if isinstance(last, Segment) and isinstance(seg, Segment) and last.count == 1 and seg.count == 1 and last.file == seg.file and (
            seg.file is None or last.offset + last.run == seg.offset
        ):
            out[-1] = Segment(last.file, last.offset, last.run + seg.run)
        else:
            out.append(seg)

    def pad(n: int) -> None:
        emit(Segment(None, 0, n))

    def walk(d: int, prefix: list[Interval]) -> None:
        block = math.prod(selection_shape(sel[d + 1 :])) * gt.itemsize
        # rows of dim d at once: one strided run per interval of dim k (k is not padded there)
        fast = d == k - 1 and sel[k][-1][1] <= shape[k]
        for a, b in sel[d]:
            hi = min(b, shape[d])
            if d == k:
                if hi > a:
                    piece, offset, _ = index.locate([*prefix, (a, hi), *tail])
                    emit(Segment(str(piece.info.file), offset, (hi - a) * inner_bytes))
            elif fast and hi > a:
                parts = []
                for c, e in sel[k]:
                    piece, offset, strides = index.locate([*prefix, (a, hi), (c, e), *tail])
                    parts.append(Segment(str(piece.info.file), offset, (e - c) * inner_bytes, hi - a, strides[d]))
                emit(parts[0] if len(parts) == 1 else Interleave(tuple(parts)))
            else:
                for i in range(a, hi):
                    walk(d + 1, [*prefix, (i, i + 1)])
            if b > max(a, shape[d]):
                pad((b - max(a, shape[d])) * block)

    walk(0, [])
    return tuple(out)


def layout(
    items: list[OutTensor], meta: dict[str, str], files: dict[str, tuple[int, int | str]], *, rank: int = 0,
    world: int = 1,
) -> RankPlan:
    """Order tensors (by dtype, then name, as safetensors does: `data_order`) and build the header."""
    items.sort(key=lambda t: data_order(t.name, t.dtype))
    placed, pos = [], 0
    for t in items:
        n = math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        assert n == sum(s.nbytes for s in t.segments), t.name
        placed.append(dataclasses.replace(t, begin=pos, end=pos + n))
        pos += n
    header = encode_header(meta, [(t.name, t.dtype, t.shape, t.begin, t.end) for t in placed])
    return RankPlan(rank, world, tuple(placed), header, files)

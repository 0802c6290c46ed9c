"""Boxes -> a planned file: the consumer's own description of what it holds, planned as a rank is.

A rank plan is one way to say which blocks of which tensors a reader gets; a list of boxes
(`reshard.format.box_request.Box`: name, offsets, sizes) is another, the one a destination that knows
what it holds gives (a DTensor's placements, torch DCP's read items). `plan_boxes` turns the boxes into
the same `RankPlan` a layout's rank gets: one output tensor per box with the source byte runs
(`reshard.plan.segments.segments_for`) that make it, from any source (a checkpoint, rank files of any
layout; local, in a store or on an HTTP server). So `RankStream` streams it, reading only the bytes the
boxes cover, row blocks of row-split boxes gathered from one read each, every sink of a rank plan
(the service's body, a file, a fill) takes it, and nothing is read before every box is checked.

    plan = plan_boxes(source, [Box("lm_head.weight", (0, 0), (128, 4096))])
    with RankStream(plan) as stream: ...          # the answer: a safetensors file, one entry per box

Bounds on the work one request can cause: `max_bytes` (the answer's tensor bytes) and `max_runs` (an
upper bound of the separate source runs the boxes are made of: a box of single elements from each row
of a 3-d tensor is a run per row, which planning and reading pay for one by one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from reshard.errors import BoxError
from reshard.format.box_request import Box, box_keys, check_boxes, encode_box_metadata
from reshard.format.checkpoint import GlobalTensor, Source
from reshard.gcpause import paused_gc
from reshard.plan.reads import Extent, Interleave
from reshard.plan.segments import layout, segments_for
from reshard.plan.types import OutTensor, RankPlan, source_files

__all__ = ["BOX_KIND", "box_bytes", "plan_boxes", "runs_bound"]

BOX_KIND = "box"  # the kind of a box's output tensor (it is cut by no rule)


def box_bytes(gt: GlobalTensor, box: Box) -> int:
    return math.prod(box.sizes) * gt.itemsize


def runs_bound(gt: GlobalTensor, box: Box) -> int:
    """An upper bound of the extents `segments_for` makes for `box` of `gt`, found without making them:
    the rows of the dims before the last one the box (or a piece of `gt`) does not hold whole, each of
    which is one (strided) extent per piece."""
    shape = gt.shape
    split = [any(p.select[d] != ((0, n),) for p in gt.pieces) for d, n in enumerate(shape)]
    k = max((d for d, n in enumerate(shape) if split[d] or box.offsets[d] != 0 or box.sizes[d] != n), default=-1)
    return math.prod(box.sizes[: max(k - 1, 0)]) * len(gt.pieces)


def plan_boxes(source: Source, boxes: Sequence[Box], *, max_bytes: int | None = None,
               max_runs: int | None = None, where: str | None = None) -> RankPlan:
    """The plan of the answer to `boxes` of `source` (the module docstring): a `RankPlan` of rank 0 of a
    world of 1 whose tensors are the boxes, named by `box_keys`, and whose files are only those the boxes
    read. `BoxError` (nothing planned) for a box that names no tensor, does not fit it or is asked for
    twice, or when the boxes pass `max_bytes` or `max_runs`; `where` names the source in errors."""
    where = where or str(source.root)
    tensors = source.global_tensors()
    check_boxes(boxes, lambda n: tensors[n].shape if n in tensors else None, where=where)
    held = [tensors[b.name] for b in boxes]
    _check_work(boxes, held, max_bytes, max_runs, where)
    keys = box_keys(boxes)
    items: list[OutTensor] = []
    with paused_gc():
        for box, key, gt in zip(boxes, keys, held):
            sel = box.selection
            items.append(OutTensor(key, gt.dtype, box.sizes, gt.shape, BOX_KIND, {}, sel, segments_for(gt, sel)))
    used = {f for t in items for s in t.segments for f in _files(s)}
    files = {path: key for path, key in source_files(source).items() if path in used}
    return layout(items, encode_box_metadata(boxes, keys, [gt.shape for gt in held]), files)


def _check_work(boxes: Sequence[Box], held: Sequence[GlobalTensor], max_bytes: int | None, max_runs: int | None,
                where: str) -> None:
    if max_bytes is not None:
        total = sum(map(box_bytes, held, boxes))
        if total > max_bytes:
            raise BoxError(f"{where}: {len(boxes)} boxes of {total} bytes in all, over the {max_bytes} bytes one "
                           "request may ask for; split them over several requests")
    if max_runs is not None:
        runs = sum(map(runs_bound, held, boxes))
        if runs > max_runs:
            worst = max(range(len(boxes)), key=lambda i: runs_bound(held[i], boxes[i]))
            raise BoxError(f"{where}: the boxes are made of up to {runs} separate runs of source bytes, over the "
                           f"{max_runs} one request may cause (box {worst}, {boxes[worst].name}{boxes[worst].slices}, "
                           f"alone up to {runs_bound(held[worst], boxes[worst])}); ask for whole rows of the last "
                           "dims, or split the boxes over several requests")


def _files(ext: Extent) -> list[str]:
    parts = ext.parts if isinstance(ext, Interleave) else (ext,)
    return [p.file for p in parts if p.file is not None]

"""Fast rank planning for checkpoints of many tensors that share shape, dtype and rule (MoE experts).

`RankPlanner(tensors, files, rules, tp).plan(rank)` returns exactly what planning each tensor on its
own gives (`reshard.plan.segments_for`, `OutTensor.describe`, `layout`), byte for byte, but does the
work once per *layout group*: tensors stored whole in one file, with the same rule (and name
suffix), shape and dtype get the same selection, the same output shape and description, and the same
source byte runs shifted by where the tensor starts in its file. Per tensor and rank what is left is
building its `OutTensor` and `Segment`s and its header entry.

The header is assembled from per-group JSON fragments instead of `json.dumps` of the whole dict; the
fragments are made by `json.dumps` with the same options, so the bytes are the same (a test compares
with the per-tensor planner's output on a large synthetic checkpoint).
"""

from __future__ import annotations

import gc
import json
import math
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from json.encoder import encode_basestring_ascii as _json_str  # type: ignore[attr-defined]
from typing import Any, overload

from reshard.format import DTYPE_SIZES, GlobalTensor
from reshard.loaders import Selection, full_selection, selection_shape
from reshard.manifest import Rule
from reshard.plan import (
    FORMAT,
    Extent,
    Interleave,
    OutTensor,
    RankPlan,
    Segment,
    check_tp,
    segments_for,
    tensor_selection,
)
from reshard.reads import bytes_read

_COMPACT = (",", ":")
_new = object.__new__


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside: planning makes ~10 objects per tensor and no cycles, and
    with 100,000 tensors the collector's full passes over them cost more than the planning itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class _Layout:
    """What every tensor of one group gets on one rank; `segments` are those of tensor `base_name`
    (at `base_start` in `base_file`), the others' are the same shifted."""

    selection: Selection
    shape: tuple[int, ...]
    nbytes: int
    read: int  # bytes the stream reads from source files (`reads.bytes_read`: row spans included)
    replicated: bool
    segments: tuple[Extent, ...]
    base_file: str
    base_start: int
    describe: str  # JSON of OutTensor.describe(), sort_keys, compact
    entry: str  # '{"dtype":..,"shape":[..],"data_offsets":['


def _shift(ext: Extent, file: str, delta: int) -> Extent:
    if isinstance(ext, Interleave):
        return Interleave(tuple(_shift(p, file, delta) for p in ext.parts))  # type: ignore[misc]
    if ext.file is None:
        return ext  # zero padding: immutable, shared
    seg = _new(Segment)  # a frozen dataclass built without its per-field __setattr__ (same object)
    seg.__dict__.update(file=file, offset=ext.offset + delta, run=ext.run, count=ext.count, stride=ext.stride)
    return seg


class PlannedTensors(Sequence[OutTensor]):
    """One rank's tensors in file order, each built when it is read: what is held per tensor is its
    group number (shared by every rank) and its end offset (a rank of 100,000 tensors is ~1 MB, not
    ~60 MB of objects). Compares equal to the tuple of its tensors."""

    def __init__(self, planner: RankPlanner, layouts: list[_Layout], ends: array[int]) -> None:
        self._planner, self._layouts, self._ends = planner, layouts, ends

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, i: int) -> OutTensor: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[OutTensor, ...]: ...

    def __getitem__(self, i: int | slice) -> OutTensor | tuple[OutTensor, ...]:
        if isinstance(i, slice):
            return tuple(self._make(j) for j in range(*i.indices(len(self))))
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._make(i % len(self))

    def __iter__(self) -> Iterator[OutTensor]:
        return map(self._make, range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PlannedTensors({len(self)} tensors)"

    @property
    def end(self) -> int:
        """End of the data region."""
        return self._ends[-1] if self._ends else 0

    def stats(self) -> tuple[int, int]:
        """(replicated bytes, bytes read from sources), summed by group."""
        counts = Counter(self._planner.gids)
        return (sum(n * self._layouts[g].nbytes for g, n in counts.items() if self._layouts[g].replicated),
                sum(n * self._layouts[g].read for g, n in counts.items()))

    def _make(self, i: int) -> OutTensor:
        planner = self._planner
        name, gt = planner.order[i]
        g = self._layouts[planner.gids[i]]
        end = self._ends[i]
        file, start = planner.where[i]
        delta = start - g.base_start
        if delta == 0 and file == g.base_file:
            segments = g.segments
        else:
            segments = tuple([_shift(s, file, delta) for s in g.segments])
        rule = planner.rules[name]
        t = _new(OutTensor)  # a frozen dataclass built without its per-field __setattr__ (same object)
        t.__dict__.update(name=name, dtype=gt.dtype, shape=g.shape, global_shape=gt.shape, kind=rule.kind,
                          options=dict(rule.options), selection=g.selection, segments=segments,
                          begin=end - g.nbytes, end=end)
        return t


class RankPlanner:
    """Plans every rank of `tp` for one set of tensors and rules: tensors are sorted into layout
    groups once; each rank then computes one layout per group and, per tensor, its offsets and header
    entry with list comprehensions."""

    def __init__(self, tensors: dict[str, GlobalTensor], files: dict[str, tuple[int, int]],
                 rules: dict[str, Rule], tp: int) -> None:
        check_tp(tp)
        self.tensors, self.files, self.rules, self.tp = tensors, files, rules, tp
        full: dict[tuple[int, ...], Any] = {}
        group_of: dict[Any, int] = {}
        self.firsts: list[str] = []  # the first tensor (in source order) of each group
        gid_by_name: dict[str, int] = {}
        for name, gt in tensors.items():
            key: Any = name  # planned on its own unless it is stored whole in one file
            pieces = gt.pieces
            if len(pieces) == 1:
                sel = full.get(gt.shape)
                if sel is None:
                    sel = full[gt.shape] = full_selection(gt.shape)
                if pieces[0].select is sel or pieces[0].select == sel:
                    key = (id(rules[name]), name[name.rfind(".") :] if "." in name else "", gt.shape, gt.dtype)
            gid = group_of.get(key)
            if gid is None:
                gid = group_of[key] = len(self.firsts)
                self.firsts.append(name)
            gid_by_name[name] = gid
        names = sorted(tensors)  # the metadata's key order (json sort_keys)
        by_size: dict[int, list[str]] = {}  # file order: largest item size first, then name (data_order)
        for n in names:
            by_size.setdefault(DTYPE_SIZES[tensors[n].dtype], []).append(n)
        ordered = [n for size in sorted(by_size, reverse=True) for n in by_size[size]]
        self.order = [(n, tensors[n]) for n in ordered]
        self.where = [(str(gt.pieces[0].info.file), gt.pieces[0].info.start) for _, gt in self.order]
        self.gids = [gid_by_name[n] for n in ordered]
        quoted = {n: _json_str(n) + ":" for n in names}
        self._quoted = [quoted[n] for n in ordered]
        self._sorted_gids = [gid_by_name[n] for n in names]
        self._sorted_quoted = list(quoted.values())
        self._layouts: dict[int, list[_Layout]] = {}
        self._entries: tuple[Any, array[int], str] | None = None  # the last rank's header entries

    def layouts(self, rank: int) -> list[_Layout]:
        """Each group's layout on `rank` (all a bad rule or shape can fail on), made once per rank."""
        hit = self._layouts.get(rank)
        if hit is None:
            check_tp(self.tp, rank)
            # in source order, so the first bad tensor is the one an error names
            hit = self._layouts[rank] = [self._layout(name, self.tensors[name], rank) for name in self.firsts]
        return hit

    def plan(self, rank: int) -> RankPlan:
        layouts = self.layouts(rank)
        sizes, heads = [g.nbytes for g in layouts], [g.entry for g in layouts]
        same = self._entries if self._entries is not None and self._entries[0] == (sizes, heads) else None
        if same is not None:  # even splits: every rank has the same shapes and offsets, only selections differ
            ends, entries = same[1], same[2]
        else:
            ends = array("q", accumulate([sizes[g] for g in self.gids]))
            entries = ",".join([f"{q}{heads[g]}{e - sizes[g]},{e}]}}" for q, g, e in zip(self._quoted, self.gids, ends)])
            self._entries = ((sizes, heads), ends, entries)
        describe = [g.describe for g in layouts]
        blob = ",".join([q + describe[g] for q, g in zip(self._sorted_quoted, self._sorted_gids)])
        meta = {"format": FORMAT, "tp": str(self.tp), "rank": str(rank), "tensors": "{" + blob + "}"}
        del blob
        text = json.dumps({"__metadata__": meta}, separators=_COMPACT)[:-1]
        del meta
        text += ("," + entries if entries else "") + "}"
        text += " " * (-len(text) % 8)  # ASCII (json escapes the rest): as many bytes as characters
        header = len(text).to_bytes(8, "little") + text.encode()
        return RankPlan(rank, self.tp, PlannedTensors(self, layouts, ends), header, self.files)  # type: ignore[arg-type]

    def _layout(self, name: str, gt: GlobalTensor, rank: int) -> _Layout:
        rule = self.rules[name]
        sel = tensor_selection(name, gt.shape, rule, rank, self.tp)
        shape = selection_shape(sel)
        probe = OutTensor(name, gt.dtype, shape, gt.shape, rule.kind, dict(rule.options), sel, ())
        nbytes = math.prod(shape) * DTYPE_SIZES[gt.dtype]
        segments = segments_for(gt, sel)
        assert nbytes == sum(s.nbytes for s in segments), name
        read = sum(bytes_read(s) for s in segments)
        entry = json.dumps({"dtype": gt.dtype, "shape": list(shape)}, separators=_COMPACT)[:-1]
        info = gt.pieces[0].info
        return _Layout(sel, shape, nbytes, read, probe.replicated, segments, str(info.file), info.start,
                       json.dumps(probe.describe(), separators=_COMPACT, sort_keys=True),
                       entry + ',"data_offsets":[')


class LazyRanks(Sequence[RankPlan]):
    """`Plan.ranks` for a caller that visits each rank once (`reshard plan`'s summary): a rank is
    planned when it is read and not kept, so only one rank's header is in memory at a time."""

    def __init__(self, planner: RankPlanner, ranks: Sequence[int]) -> None:
        self._planner, self._ranks = planner, list(ranks)
        for r in self._ranks:  # every error now, before a caller prints anything
            planner.layouts(r)

    @property
    def planner(self) -> RankPlanner:
        """The planner behind (a caller planning more ranks of the same tp later reuses its groups)."""
        return self._planner

    def __len__(self) -> int:
        return len(self._ranks)

    @overload
    def __getitem__(self, i: int) -> RankPlan: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[RankPlan, ...]: ...

    def __getitem__(self, i: int | slice) -> RankPlan | tuple[RankPlan, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        with paused_gc():
            return self._planner.plan(self._ranks[i])

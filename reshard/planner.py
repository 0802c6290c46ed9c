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

import json
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from json.encoder import encode_basestring_ascii as _json_str  # type: ignore[attr-defined]
from operator import attrgetter, sub
from typing import Any, TypeVar, overload

from reshard.format import DTYPE_SIZES, GlobalTensor
from reshard.gcpause import paused_gc
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

__all__ = ["LazyRanks", "Pieces", "PlannedTensors", "RankPlanner", "paused_gc"]

_COMPACT = (",", ":")
_new = object.__new__


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


T = TypeVar("T")


class _Lazy(Sequence[T]):
    """A sequence whose items are made when read: a subclass gives `__len__` and `_item(i)` for
    0 <= i < len; indexing works as a list's (negative indices, IndexError past the end), a slice
    gives a `_slice` of the items (a tuple unless said otherwise)."""

    _slice: Callable[[Iterator[T]], Sequence[T]] = tuple

    def _item(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[T]: ...

    def __getitem__(self, i: int | slice) -> T | Sequence[T]:
        if isinstance(i, slice):
            return self._slice(map(self._item, range(*i.indices(len(self)))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self._item(i % n)


class PlannedTensors(_Lazy[OutTensor]):
    """One rank's tensors in file order, each built when it is read: what is held per tensor is its
    group number (shared by every rank) and its end offset (a rank of 100,000 tensors is ~1 MB, not
    ~60 MB of objects). Compares equal to the tuple of its tensors."""

    def __init__(self, planner: RankPlanner, layouts: list[_Layout], ends: array[int]) -> None:
        self._planner, self._layouts, self._ends = planner, layouts, ends
        self._index: tuple[array[int], Pieces] | None = None

    def __len__(self) -> int:
        return len(self._ends)

    def _item(self, i: int) -> OutTensor:
        return self._make(i)

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
        counts = self._planner.group_counts()
        return (sum(n * self._layouts[g].nbytes for g, n in counts.items() if self._layouts[g].replicated),
                sum(n * self._layouts[g].read for g, n in counts.items()))

    def piece_index(self, header: bytes) -> tuple[array[int], Pieces]:
        """`RankStream`'s index of the rank file with this header: where each piece starts (the
        header, then every non-empty extent of every tensor, in order) and the pieces, each made when
        read. Built once per plan (a few ms for 100,000 tensors), then shared by its streams."""
        hit = self._index
        if hit is not None and hit[1].header is header:
            return hit
        planner, layouts = self._planner, self._layouts
        # per group: (extent number, offset in the tensor) of its non-empty extents
        parts = [[(k, pos) for k, (pos, e) in enumerate(zip(accumulate((e.nbytes for e in g.segments), initial=0),
                                                              g.segments)) if e.nbytes] for g in layouts]
        sizes = [g.nbytes for g in layouts]
        begins = map(len(header).__add__, map(sub, self._ends, map(sizes.__getitem__, planner.gids)))
        starts = array("q", [0])
        if all(p == [(0, 0)] for p in parts):  # one extent a tensor, at its start (the usual case)
            starts.extend(begins)
            owners = None
        else:
            owners = array("q")  # per piece: tensor number << 32 | extent number
            for i, (b, g) in enumerate(zip(begins, planner.gids)):
                for k, pos in parts[g]:
                    starts.append(b + pos)
                    owners.append(i << 32 | k)
        if len(starts) > 1:  # the last piece ends the file
            assert starts[-1] + self._piece(owners, len(starts) - 2).nbytes == len(header) + self.end
        self._index = (starts, Pieces(self, header, owners, len(starts)))
        return self._index

    def _piece(self, owners: array[int] | None, j: int) -> Extent:
        """Piece j (after the header) of the index: tensor i's extent k, shifted to where i is."""
        i, k = (j, 0) if owners is None else divmod(owners[j], 1 << 32)
        planner = self._planner
        g = self._layouts[planner.gids[i]]
        file, start = planner.where[i]
        delta = start - g.base_start
        ext = g.segments[k]
        return ext if delta == 0 and file == g.base_file else _shift(ext, file, delta)

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


class Pieces(_Lazy[bytes | Extent]):
    """The pieces of a rank file as `RankStream` indexes them: the header, then each non-empty
    extent of each tensor, made when read (slices are lists, as the list it stands for gives)."""

    _slice = list

    def __init__(self, tensors: PlannedTensors, header: bytes, owners: array[int] | None, n: int) -> None:
        self._tensors, self.header, self._owners, self._n = tensors, header, owners, n

    def __len__(self) -> int:
        return self._n

    def _item(self, j: int) -> bytes | Extent:
        return self.header if j == 0 else self._tensors._piece(self._owners, j - 1)

    def __iter__(self) -> Iterator[bytes | Extent]:
        yield self.header
        make, owners = self._tensors._piece, self._owners
        for j in range(self._n - 1):
            yield make(owners, j)


class RankPlanner:
    """Plans every rank of `tp` for one set of tensors and rules: tensors are sorted into layout
    groups once; each rank then computes one layout per group and, per tensor, its offsets and header
    entry with list comprehensions."""

    def __init__(self, tensors: dict[str, GlobalTensor], files: dict[str, tuple[int, int]],
                 rules: dict[str, Rule], tp: int) -> None:
        check_tp(tp)
        self.tensors, self.files, self.rules, self.tp = tensors, files, rules, tp
        infos = getattr(tensors, "infos", None)  # format.WholeTensors: every tensor is one whole piece
        if infos is not None:
            # grouped by (rule, name suffix, shape, dtype), read from the TensorInfos (no GlobalTensor made)
            keys = list(zip(map(id, map(rules.__getitem__, infos)), [n[n.rfind(".") :] if "." in n else "" for n in infos],
                            map(attrgetter("shape"), infos.values()), map(attrgetter("dtype"), infos.values())))
            meta, loc = infos, infos  # each tensor's dtype and shape; where it starts
        else:  # the same for tensors stored whole in one file; others are planned alone
            full = {shape: full_selection(shape) for shape in {gt.shape for gt in tensors.values()}}
            keys = [(id(rules[n]), n[n.rfind(".") :] if "." in n else "", gt.shape, gt.dtype)
                    if len(gt.pieces) == 1 and (gt.pieces[0].select is full[gt.shape] or gt.pieces[0].select == full[gt.shape])
                    else n for n, gt in tensors.items()]
            meta, loc = tensors, {n: gt.pieces[0].info for n, gt in tensors.items()}
        gid_of = {key: gid for gid, key in enumerate(dict.fromkeys(keys))}  # numbered in source order
        src = list(tensors)
        src_gids = list(map(gid_of.__getitem__, keys))
        del keys
        first_of = dict(zip(reversed(src_gids), reversed(src)))
        self.firsts: list[str] = [first_of[gid] for gid in range(len(gid_of))]  # the first tensor (in source order) of each group
        names = sorted(src)  # the metadata's key order (json sort_keys)
        in_order = names == src  # (a Checkpoint's tensors are)
        name_gids = src_gids if in_order else list(map(dict(zip(src, src_gids)).__getitem__, names))
        ordered = names  # file order: largest item size first, then name (data_order)
        if len({DTYPE_SIZES[t.dtype] for t in meta.values()}) > 1:
            by_size: dict[int, list[str]] = {}
            for n in names:
                by_size.setdefault(DTYPE_SIZES[meta[n].dtype], []).append(n)
            ordered = [n for size in sorted(by_size, reverse=True) for n in by_size[size]]
        if in_order and ordered is names:
            self.order = list(meta.items())  # (name, its dtype and shape)
            self.where = _places(loc.values())
            self.gids = name_gids
        else:
            self.order = list(zip(ordered, map(meta.__getitem__, ordered)))
            self.where = _places(map(loc.__getitem__, ordered))
            self.gids = name_gids if ordered is names else list(map(dict(zip(names, name_gids)).__getitem__, ordered))
        self._sorted_gids = name_gids
        self._counts: Counter[int] | None = None
        # '"name":' in file order, and in name order escaped as the content of a JSON string (the
        # metadata's "tensors" value), each with a comma before it but the first
        if len(_json_str("".join(names))) == 2 + sum(map(len, names)):  # no name needs escaping
            self._quoted = _first_bare([f',"{n}":' for n in ordered])
            self._sorted_quoted = _first_bare([f',\\"{n}\\":' for n in names])
        else:
            quoted = {n: _json_str(n) + ":" for n in names}
            self._quoted = _first_bare(["," + quoted[n] for n in ordered])
            self._sorted_quoted = _first_bare(["," + _json_str(q)[1:-1] for q in quoted.values()])
        self._layouts: dict[int, list[_Layout]] = {}
        self._entries: tuple[Any, array[int], str] | None = None  # the last rank's header entries

    def group_counts(self) -> Counter[int]:
        """How many tensors each group has."""
        if self._counts is None:
            self._counts = Counter(self.gids)
        return self._counts

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
            ends = array("q", accumulate(map(sizes.__getitem__, self.gids)))
            stops = list(map(str, ends))  # a tensor begins where the one before it ends
            n = len(stops)
            entries = "".join(_rows(self._quoted, list(map(heads.__getitem__, self.gids)), ["0", *stops[:-1]][:n],
                                    [","] * n, stops, ["]}"] * n))
            self._entries = ((sizes, heads), ends, entries)
        # JSON string escaping is done character by character, so the escaped "tensors" value is the
        # escaped fragments joined: names once (in __init__), descriptions once per group
        describe = [_json_str(g.describe)[1:-1] for g in layouts]
        meta = {"format": FORMAT, "tp": str(self.tp), "rank": str(rank), "tensors": ""}
        head = json.dumps({"__metadata__": meta}, separators=_COMPACT)[:-3]  # up to the opening quote of ""
        parts = _rows(self._sorted_quoted, list(map(describe.__getitem__, self._sorted_gids)))
        parts[:0] = [head, "{"]
        parts += ['}"}', "," if entries else "", entries, "}"]
        size = sum(map(len, parts))
        parts.append(" " * (-size % 8))
        # all ASCII (json escapes the rest), so latin-1 gives the same bytes as utf-8; with the length
        # prefix as its 8 characters, the header is one join and one encode
        parts.insert(0, (size + -size % 8).to_bytes(8, "little").decode("latin-1"))
        header = "".join(parts).encode("latin-1")
        del parts
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


def _places(infos: Iterable[Any]) -> list[tuple[str, int]]:
    """(file as a string, start) of each TensorInfo; a file's tensors usually share its path object,
    so each is made a string once."""
    infos = list(infos)
    files = list(map(attrgetter("file"), infos))
    ids = list(map(id, files))
    paths = {i: str(f) for i, f in dict(zip(ids, files)).items()}
    return list(zip(map(paths.__getitem__, ids), map(attrgetter("start"), infos)))


def _first_bare(items: list[str]) -> list[str]:
    """Comma-led `items` with the first comma dropped: joined, they are `",".join` of the bare ones."""
    if items:
        items[0] = items[0][1:]
    return items


def _rows(*columns: list[str]) -> list[str]:
    """The columns' strings row by row: joined, `"".join(a + b + ... for a, b, ... in zip(*columns))`
    without a string per row."""
    width = len(columns)
    parts = [""] * (width * len(columns[0]))
    for j, column in enumerate(columns):
        parts[j::width] = column
    return parts


class LazyRanks(_Lazy[RankPlan]):
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

    def _item(self, i: int) -> RankPlan:
        with paused_gc():
            return self._planner.plan(self._ranks[i])

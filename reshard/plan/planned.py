"""One rank's planned tensors, each made when it is read (`RankPlanner.plan` returns them).

What is held per tensor is its group number (shared by every rank) and its end offset: a rank of
100,000 tensors is ~1 MB, not ~60 MB of objects.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from operator import sub
from typing import Any, TypeVar, overload

from reshard.format.selection import Selection
from reshard.plan.reads import Extent, Interleave, Segment
from reshard.plan.types import OutTensor, RankPlan
from reshard.rules.manifest import Rule

T = TypeVar("T")


@dataclass(frozen=True)
class TensorGroups:
    """What every rank a `RankPlanner` plans shares, per tensor in file order: `order` (name, and what
    has its dtype and shape), `where` (source file as a string, start) and `gids` (its group number);
    `rules` each tensor's rule."""

    order: list[tuple[str, Any]]
    where: list[tuple[str, int]]
    gids: list[int]
    rules: Mapping[str, Rule]

    @cached_property
    def counts(self) -> Counter[int]:
        """How many tensors each group has (counted when first asked)."""
        return Counter(self.gids)


@dataclass(frozen=True)
class GroupLayout:
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
    placed: str = ""  # its DCP_SHARDING_INFO value (`reshard.format.rank_file.dcp_fragment`), "" when none


def _shift(ext: Extent, file: str, delta: int) -> Extent:
    if isinstance(ext, Interleave):
        return Interleave(tuple(_shift(p, file, delta) for p in ext.parts))  # type: ignore[misc]
    if ext.file is None:
        return ext  # zero padding: immutable, shared
    return _frozen(Segment, {"file": file, "offset": ext.offset + delta, "run": ext.run, "count": ext.count,
                             "stride": ext.stride})


_new = object.__new__


def _frozen(cls: type[T], fields: dict[str, Any]) -> T:
    """`cls(**fields)` for a frozen dataclass given every field (the same object, equal and hashed
    alike), without the per-field `object.__setattr__` its `__init__` pays: one is made for every
    tensor and segment a stream reads. (A dict, not keywords: a call with keywords costs more.)"""
    obj = _new(cls)
    obj.__dict__.update(fields)
    return obj


class LazySequence(Sequence[T]):
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


class PlannedTensors(LazySequence[OutTensor]):
    """One rank's tensors in file order, each built when it is read: what is held per tensor is its
    group number (shared by every rank) and its end offset (a rank of 100,000 tensors is ~1 MB, not
    ~60 MB of objects). Compares equal to the tuple of its tensors; `Summarized` (`end`, `stats`)."""

    def __init__(self, groups: TensorGroups, layouts: list[GroupLayout], ends: array[int]) -> None:
        self._groups, self._layouts, self._ends = groups, layouts, ends
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
        counts = self._groups.counts
        return (sum(n * self._layouts[g].nbytes for g, n in counts.items() if self._layouts[g].replicated),
                sum(n * self._layouts[g].read for g, n in counts.items()))

    def piece_index(self, header: bytes) -> tuple[array[int], Pieces]:
        """`RankStream`'s index of the rank file with this header: where each piece starts (the
        header, then every non-empty extent of every tensor, in order) and the pieces, each made when
        read. Built once per plan (a few ms for 100,000 tensors), then shared by its streams."""
        hit = self._index
        if hit is not None and hit[1].header is header:
            return hit
        groups, layouts = self._groups, self._layouts
        # per group: (extent number, offset in the tensor) of its non-empty extents
        parts = [[(k, pos) for k, (pos, e) in enumerate(zip(accumulate((e.nbytes for e in g.segments), initial=0),
                                                              g.segments)) if e.nbytes] for g in layouts]
        sizes = [g.nbytes for g in layouts]
        begins = map(len(header).__add__, map(sub, self._ends, map(sizes.__getitem__, groups.gids)))
        starts = array("q", [0])
        if all(p == [(0, 0)] for p in parts):  # one extent a tensor, at its start (the usual case)
            starts.extend(begins)
            owners = None
        else:
            owners = array("q")  # per piece: tensor number << 32 | extent number
            for i, (b, g) in enumerate(zip(begins, groups.gids)):
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
        groups = self._groups
        g = self._layouts[groups.gids[i]]
        file, start = groups.where[i]
        delta = start - g.base_start
        ext = g.segments[k]
        return ext if delta == 0 and file == g.base_file else _shift(ext, file, delta)

    def _make(self, i: int) -> OutTensor:
        groups = self._groups
        name, gt = groups.order[i]
        g = self._layouts[groups.gids[i]]
        end = self._ends[i]
        file, start = groups.where[i]
        delta = start - g.base_start
        if delta == 0 and file == g.base_file:
            segments = g.segments
        else:
            segments = tuple([_shift(s, file, delta) for s in g.segments])
        rule = groups.rules[name]
        return _frozen(OutTensor, {"name": name, "dtype": gt.dtype, "shape": g.shape, "global_shape": gt.shape,
                                   "kind": rule.kind, "options": dict(rule.options), "selection": g.selection,
                                   "segments": segments, "begin": end - g.nbytes, "end": end})


class Pieces(LazySequence[bytes | Extent]):
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


def piece_index(plan: RankPlan) -> tuple[Sequence[int], Sequence[bytes | Segment | Interleave]]:
    """Where each piece of `plan`'s rank file starts and the pieces: the header, then every non-empty
    extent of every tensor, in order (`RankStream` reads by it). A planner's plan (`PlannedTensors`) has
    it built once per plan, each piece made when read; any other plan's is the plain loop below, which
    the planner's equals."""
    if isinstance(plan.tensors, PlannedTensors):
        return plan.tensors.piece_index(plan.header)
    starts: list[int] = [0]
    pieces: list[bytes | Segment | Interleave] = [plan.header]
    pos = len(plan.header)
    for t in plan.tensors:
        for seg in t.segments:
            if seg.nbytes:
                starts.append(pos)
                pieces.append(seg)
                pos += seg.nbytes
    if pos != plan.size:
        raise AssertionError(f"rank {plan.rank}: pieces end at byte {pos}, the plan's size is {plan.size}")
    return starts, pieces

"""The pure plan: (checkpoint headers, manifest, tp) -> what every rank file contains, byte for byte.

No tensor data is read. For each rank the plan lists every output tensor (name, dtype, shape, the
global tensor and selection it comes from, the source byte runs that make it up) and the exact
safetensors header, so the file size and every offset are known before the first byte is produced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from reshard.errors import PlanError
from reshard.format import DTYPE_SIZES, GlobalTensor, Piece, Source, encode_header
from reshard.loaders import Interval, Selection, full_selection, loader_for, selection_shape
from reshard.manifest import Manifest, Rule

MAX_TP = 4096
FORMAT = "reshard.rank/1"
_REPLICATE = Rule("*", "replicate")


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
class OutTensor:
    """One tensor of a rank file: its bytes are `segments` in order, at data offsets [begin, end)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    kind: str
    options: dict[str, Any]
    selection: Selection
    segments: tuple[Extent, ...]
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def replicated(self) -> bool:
        return self.selection == full_selection(self.global_shape)

    def describe(self) -> dict[str, Any]:
        """The self-description stored in the rank file's metadata."""
        out: dict[str, Any] = {"kind": self.kind, "shape": list(self.global_shape),
                               "select": [[list(iv) for iv in dim] for dim in self.selection]}
        if self.options:
            out["options"] = self.options
        return out


@dataclass(frozen=True)
class RankPlan:
    """Everything rank `rank` of `tp` receives; `header` is the exact safetensors header bytes."""

    rank: int
    tp: int
    tensors: tuple[OutTensor, ...]
    header: bytes
    files: dict[str, tuple[int, int | str]] = field(default_factory=dict)  # source -> (size, mtime_ns or ETag)

    @property
    def size(self) -> int:
        end = getattr(self.tensors, "end", None)  # planner.PlannedTensors knows it without building a tensor
        return len(self.header) + (end if end is not None else self.tensors[-1].end if self.tensors else 0)

    def stats(self) -> dict[str, int]:
        by_group = getattr(self.tensors, "stats", None)  # planner.PlannedTensors sums by layout group
        if by_group is not None:
            replicated, read = by_group()
        else:
            replicated = sum(t.nbytes for t in self.tensors if t.replicated)
            from reshard.reads import bytes_read  # reads imports this module

            read = sum(bytes_read(s) for t in self.tensors for s in t.segments)
        return {"tensors": len(self.tensors), "bytes": self.size, "replicated_bytes": replicated, "bytes_read": read}


def rank_file_name(rank: int, tp: int) -> str:
    return f"rank-{rank:05d}-of-{tp:05d}.safetensors"


def check_tp(tp: Any, rank: Any = None) -> None:
    if type(tp) is not int or not 1 <= tp <= MAX_TP:
        raise PlanError(f"tp={tp!r} must be an integer from 1 to {MAX_TP}")
    if rank is not None and (type(rank) is not int or not 0 <= rank < tp):
        raise PlanError(f"rank={rank!r} is out of range for tp={tp} (0..{tp - 1})")


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


def _check_selection(name: str, shape: tuple[int, ...], sel: Selection) -> None:
    if len(sel) != len(shape) or any(a < 0 or b < a for dim in sel for a, b in dim):
        raise PlanError(f"{name}: loader returned an invalid selection {sel} for shape {list(shape)}")


def tensor_selection(name: str, shape: tuple[int, ...], rule: Rule, rank: int, tp: int) -> Selection:
    """The selection `rule` gives rank `rank` of `tp` for tensor `name`; errors name the tensor."""
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    try:
        sel = loader_for(rule, suffix).select(shape, rank, tp)
    except PlanError as e:
        raise PlanError(f"{name}: {e} (rule {rule.pattern!r}, kind {rule.kind})") from None
    _check_selection(name, shape, sel)
    return sel


def resolve_rules(ckpt_tensors: Sequence[str], manifest: Manifest, *, strict: bool = False) -> tuple[dict[str, Rule], list[str]]:
    """Each tensor's rule (default replicate) and warnings for rules that match nothing."""
    matched = manifest.match_all(ckpt_tensors)
    chosen: dict[str, Rule] = dict(zip(ckpt_tensors, matched))  # type: ignore[arg-type]
    unmatched = [name for name, rule in chosen.items() if rule is None]
    for name in unmatched:
        chosen[name] = _REPLICATE
    if unmatched and manifest.strict:
        raise PlanError(
            f"{len(unmatched)} tensors match no rule and the manifest is strict, e.g. {unmatched[0]!r}; "
            "add a rule (kind replicate for norms) or drop `strict`"
        )
    used = set(map(id, chosen.values()))
    unused = [f"rule {r.pattern!r} ({r.kind}) matches no tensor" for r in manifest.rules if id(r) not in used]
    if unused and strict:
        raise PlanError(f"{unused[0]}; {len(unused)} such rules under --strict")
    return chosen, unused


def plan_rank(
    tensors: dict[str, GlobalTensor], files: dict[str, tuple[int, int | str]], rules: dict[str, Rule], tp: int, rank: int
) -> RankPlan:
    """One rank's plan; `tensors` from the source, `files` from `source_files`, `rules` from `resolve_rules`."""
    from reshard.planner import RankPlanner  # it builds on this module's types

    return RankPlanner(tensors, files, rules, tp).plan(rank)


def rank_metadata(tp: int, rank: int, tensors: dict[str, dict[str, Any]]) -> dict[str, str]:
    """A rank file's `__metadata__`: format, tp, rank and every tensor's self-description."""
    describe = json.dumps(tensors, separators=(",", ":"), sort_keys=True)
    return {"format": FORMAT, "tp": str(tp), "rank": str(rank), "tensors": describe}


def data_order(name: str, dtype: str) -> tuple[int, str]:
    """Tensor order in a file: largest item size first, then name (as safetensors does)."""
    return (-DTYPE_SIZES[dtype], name)


def source_files(ckpt: Source) -> dict[str, tuple[int, int | str]]:
    return {str(f.path): f.stat_key() for f in ckpt.files}


def layout(
    items: list[OutTensor], meta: dict[str, str], files: dict[str, tuple[int, int | str]], *, rank: int = 0, tp: int = 1
) -> RankPlan:
    """Order tensors (largest item size first, then name, as safetensors does) and build the header."""
    items.sort(key=lambda t: data_order(t.name, t.dtype))
    placed, pos = [], 0
    for t in items:
        n = math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        assert n == sum(s.nbytes for s in t.segments), t.name
        placed.append(dataclasses.replace(t, begin=pos, end=pos + n))
        pos += n
    header = encode_header(meta, [(t.name, t.dtype, t.shape, t.begin, t.end) for t in placed])
    return RankPlan(rank, tp, tuple(placed), header, files)


@dataclass(frozen=True)
class Plan:
    """Every rank's plan plus what identifies it (source files, manifest, tp)."""

    tp: int
    ranks: tuple[RankPlan, ...]
    manifest: Manifest
    identity: dict[str, Any]
    warnings: tuple[str, ...] = ()

    @property
    def digest(self) -> str:
        blob = json.dumps(self.identity, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def make_plan(
    ckpt: Source, manifest: Manifest, tp: int, *, ranks: Sequence[int] | None = None, strict: bool = False,
    lazy: bool = False,
) -> Plan:
    """Plan `ranks` (default all) of `tp`; pure: reads no tensor data. With `lazy`, each rank is planned
    when `plan.ranks[i]` is read, and not kept (for one pass over the ranks with little memory)."""
    check_tp(tp)
    for r in ranks or ():
        check_tp(tp, r)
    from reshard.planner import LazyRanks, RankPlanner, paused_gc  # it builds on this module's types

    with paused_gc():
        tensors, files = ckpt.global_tensors(), source_files(ckpt)
        rules, warnings = resolve_rules(list(tensors), manifest, strict=strict)
        planner = RankPlanner(tensors, files, rules, tp)
        wanted = ranks if ranks is not None else range(tp)
        rank_plans: Sequence[RankPlan] = LazyRanks(planner, wanted) if lazy else tuple(planner.plan(r) for r in wanted)
    identity = {"source": ckpt.identity(), "manifest": manifest.digest(), "tp": tp, "format": FORMAT}
    return Plan(tp, rank_plans, manifest, identity, tuple(warnings))  # type: ignore[arg-type]


def plan_to_json(plan: Plan, *, tensors: bool = True) -> dict[str, Any]:
    """A JSON-able view of a plan (what `reshard plan --json` prints and the service returns)."""
    ranks = []
    for rp in plan.ranks:
        entry: dict[str, Any] = {"rank": rp.rank, "file": rank_file_name(rp.rank, rp.tp), **rp.stats(),
                                 "header_bytes": len(rp.header)}
        if tensors:
            entry["tensors"] = [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "kind": t.kind,
                 "global_shape": list(t.global_shape), "data_offsets": [t.begin, t.end],
                 "select": [[list(iv) for iv in dim] for dim in t.selection]}
                for t in rp.tensors
            ]
        ranks.append(entry)
    return {"tp": plan.tp, "plan": plan.digest, "manifest_source": plan.manifest.source,
            "warnings": list(plan.warnings), "ranks": ranks}

"""The pure plan: (checkpoint headers, manifest, tp) -> what every rank file contains, byte for byte.

No tensor data is read. For each rank the plan lists every output tensor (name, dtype, shape, the
global tensor and selection it comes from, the source byte runs that make it up) and the exact
safetensors header, so the file size and every offset are known before the first byte is produced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from reshard.format.checkpoint import DTYPE_SIZES, Source
from reshard.format.headers import DTYPE_RANK
from reshard.format.rank_file import describe_tensor, rank_file_name
from reshard.format.selection import Selection, full_selection
from reshard.layout.mesh import MAX_WORLD, Layout
from reshard.plan.reads import Extent, bytes_read
from reshard.rules.manifest import Manifest

MAX_TP = MAX_WORLD


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
        return describe_tensor(self.kind, self.global_shape, self.selection, self.options)


@runtime_checkable
class Summarized(Protocol):
    """Tensors that know their totals without building each one (`reshard.plan.planned.PlannedTensors`)."""

    @property
    def end(self) -> int:
        """End of the data region."""

    def stats(self) -> tuple[int, int]:
        """(replicated bytes, bytes read from sources)."""


@dataclass(frozen=True)
class RankPlan:
    """Everything rank `rank` of a world of `world` ranks receives; `header` is the exact safetensors
    header bytes. Its file is `rank_file_name(rank, world)`. `tensors` is a tuple, or (from the grouped
    planner) a `PlannedTensors` that makes each when it is read and is also `Summarized`."""

    rank: int
    world: int
    tensors: Sequence[OutTensor]
    header: bytes
    files: dict[str, tuple[int, int | str]] = field(default_factory=dict)  # source -> (size, mtime_ns or ETag)

    @property
    def size(self) -> int:
        if isinstance(self.tensors, Summarized):
            return len(self.header) + self.tensors.end
        return len(self.header) + (self.tensors[-1].end if self.tensors else 0)

    def stats(self) -> dict[str, int]:
        if isinstance(self.tensors, Summarized):
            replicated, read = self.tensors.stats()
        else:
            replicated = sum(t.nbytes for t in self.tensors if t.replicated)
            read = sum(bytes_read(s) for t in self.tensors for s in t.segments)
        return {"tensors": len(self.tensors), "bytes": self.size, "replicated_bytes": replicated, "bytes_read": read}


def check_tp(tp: Any, rank: Any = None) -> None:
    """`PlanError` unless `tp` is a valid tensor-parallel size and `rank` (when given) one of its ranks."""
    layout = Layout(tp=tp)
    if rank is not None:
        layout.check_rank(rank)


def data_order(name: str, dtype: str) -> tuple[int, int, str]:
    """Tensor order in a file: largest item size first, then safetensors' dtype order (`DTYPE_RANK`), then name
    (as safetensors does)."""
    return (-DTYPE_SIZES[dtype], -DTYPE_RANK[dtype], name)


def source_files(ckpt: Source) -> dict[str, tuple[int, int | str]]:
    return {str(f.path): f.stat_key() for f in ckpt.files}


@dataclass(frozen=True)
class Plan:
    """Every rank's plan plus what identifies it (source files, manifest, layout)."""

    layout: Layout
    ranks: tuple[RankPlan, ...]
    manifest: Manifest
    identity: dict[str, Any]
    warnings: tuple[str, ...] = ()

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def digest(self) -> str:
        blob = json.dumps(self.identity, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def plan_to_json(plan: Plan, *, tensors: bool = True) -> dict[str, Any]:
    """A JSON-able view of a plan (what `reshard plan --json` prints and the service returns)."""
    ranks = []
    for rp in plan.ranks:
        entry: dict[str, Any] = {"rank": rp.rank, "file": rank_file_name(rp.rank, rp.world), **rp.stats(),
                                 "header_bytes": len(rp.header)}
        if tensors:
            entry["tensors"] = [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "kind": t.kind,
                 "global_shape": list(t.global_shape), "data_offsets": [t.begin, t.end],
                 "select": [[list(iv) for iv in dim] for dim in t.selection]}
                for t in rp.tensors
            ]
        ranks.append(entry)
    return {**plan_head(plan), "ranks": ranks}


def plan_head(plan: Plan) -> dict[str, Any]:
    """What `plan_to_json` says of the plan before its ranks (the layout and world size beyond TP)."""
    head: dict[str, Any] = {"tp": plan.tp}
    if not plan.layout.tp_only:
        head.update(layout=plan.layout.sizes(), world=plan.world)
    return {**head, "plan": plan.digest, "manifest_source": plan.manifest.source, "warnings": list(plan.warnings)}

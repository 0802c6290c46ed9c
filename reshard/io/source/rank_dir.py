"""A directory of rank shards as a source: each global tensor is the pieces its rank files hold.

Rank files describe themselves (`__metadata__`: format, tp, rank, the layout beyond tp, and per tensor
the kind, options, global shape and selection), so a shard directory of any layout can be merged back
or laid out again with nothing else at hand, one tensor at a time. A tensor is the union of the pieces
the ranks hold (pipeline stages hold some tensors only, FSDP and TP pieces tile them, replicas repeat).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError, PlanError
from reshard.format.checkpoint import (
    Directory,
    FileInfo,
    GlobalTensor,
    LocalDirectory,
    Piece,
    PiecedSource,
    _read_config,
)
from reshard.format.rank_file import RankMeta, decode_metadata, is_rank_file_name, parse_rank_file_name
from reshard.format.selection import selection_shape
from reshard.layout.mesh import Layout
from reshard.layout.placement import describe_layout
from reshard.rules.manifest import Manifest, Rule


def is_shard_dir(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    return path.is_dir() and any(is_rank_file_name(p.name) for p in path.iterdir())


def has_rank_files(names: list[str] | None) -> bool:
    return any(map(is_rank_file_name, names or ()))


class ShardSet(PiecedSource):
    """The rank files of one layout in a directory, seen as one checkpoint of global tensors."""

    def __init__(self, root: Path, layout: Layout, files: list[FileInfo], tensors: dict[str, GlobalTensor],
                 config: dict[str, Any] | None, recorded_plan: str | None = None) -> None:
        self.root, self.layout, self.files, self.tensors, self.config = root, layout, files, tensors, config
        # the plan identity every file records (None: files of header revisions before 3); a plan of this set
        # at its own layout records it again, so it gives back these files byte for byte
        # (`reshard.plan.planner.make_planner`), a training checkpoint's optimizer files included
        self.recorded_plan = recorded_plan

    @property
    def tp(self) -> int:
        return self.layout.tp

    @classmethod
    def open(cls, path: str | os.PathLike[str] | Directory, *, tp: int | None = None) -> ShardSet:
        """`tp`: the world size (the number of rank files) to take when a directory holds several."""
        """The rank files in a local directory, or in a `Directory` (a store prefix that can be listed)."""
        files_in = path if hasattr(path, "header") else LocalDirectory(Path(path))
        root = files_in.root
        found: dict[int, dict[int, str]] = {}
        for name in files_in.names() or ():
            named = parse_rank_file_name(name)
            if named:
                found.setdefault(named[1], {})[named[0]] = name
        if not found:
            raise CheckpointError(f"{root}: no rank-XXXXX-of-YYYYY.safetensors files")
        if tp is None:
            if len(found) > 1:
                raise CheckpointError(f"{root}: rank files of several layouts (of {sorted(found)} ranks); remove the "
                                      "stale ones")
            tp = next(iter(found))
        ranks = found.get(tp, {})
        missing = sorted(set(range(tp)) - set(ranks))
        if missing:
            raise CheckpointError(f"{root}: {tp} rank files but ranks {missing} are missing")
        files: list[FileInfo] = []
        parts: dict[str, list[tuple[int, Piece, dict[str, Any]]]] = {}
        layouts: list[Layout] = []
        plans: list[str | None] = []
        for rank in range(tp):
            info, local = files_in.header(ranks[rank])
            files.append(info)
            lay, meta = _describe(info, rank, tp)
            desc = meta.tensors
            if layouts and lay != layouts[0]:
                raise CheckpointError(f"{info.path}: metadata says layout {lay.describe()}, rank 0 says "
                                      f"{layouts[0].describe()}; the rank files are of different writes")
            if plans and meta.plan != plans[0]:
                raise CheckpointError(f"{info.path}: written by the plan {meta.plan or '(none recorded)'}, rank 0's "
                                      f"file by the plan {plans[0] or '(none recorded)'}; the rank files are of "
                                      "different writes")
            layouts.append(lay)
            plans.append(meta.plan)
            if set(desc) != set(local):
                raise CheckpointError(f"{info.path}: metadata describes {len(desc)} tensors but the file holds {len(local)}")
            for name, t in local.items():
                d = desc[name]
                select = tuple(tuple((int(a), int(b)) for a, b in dim) for dim in d["select"])
                if selection_shape(select) != t.shape or len(select) != len(d["shape"]):
                    raise CheckpointError(f"{info.path}: tensor {name!r} has shape {list(t.shape)} but its metadata selects {d['select']}")
                parts.setdefault(name, []).append((rank, Piece(t, select), d))
        tensors = {}
        for name, pieces in sorted(parts.items()):
            first = pieces[0][2]
            for rank, piece, d in pieces:
                if (d["shape"], d["kind"], d.get("options")) != (first["shape"], first["kind"], first.get("options")) \
                        or piece.info.dtype != pieces[0][1].info.dtype:
                    raise CheckpointError(f"{root}: tensor {name!r} is described differently by rank {rank} and rank {pieces[0][0]}")
            tensors[name] = GlobalTensor(name, pieces[0][1].info.dtype, tuple(first["shape"]),
                                         tuple(p for _, p, _ in pieces), first["kind"], first.get("options") or {})
        return cls(root, layouts[0], files, tensors, _read_config(files_in), plans[0])


    def manifest(self) -> Manifest:
        """One exact-name rule per tensor, with the kind and options the shards recorded."""
        rules = tuple(Rule(re.escape(t.name), t.kind or "replicate", dict(t.options or {}), regex=True)
                      for t in self.tensors.values())
        return Manifest(rules, False, f"recorded in the {self.layout.describe()} rank shards of {self.root}")


def _describe(info: FileInfo, rank: int, world: int) -> tuple[Layout, RankMeta]:
    meta = decode_metadata(info.metadata, str(info.path))
    try:
        layout = describe_layout(meta, str(info.path))
    except PlanError as e:
        raise CheckpointError(str(e)) from None
    if meta.rank != rank or layout.world != world:
        raise CheckpointError(f"{info.path}: metadata says rank {meta.rank} of {layout.describe()} "
                              f"({layout.world} ranks), the name says rank {rank} of {world}")
    return layout, meta

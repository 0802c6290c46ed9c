"""A directory of rank shards as a source: each global tensor is the pieces its rank files hold.

Rank files describe themselves (`__metadata__`: format, tp, rank, and per tensor the kind, options,
global shape and selection), so a shard directory can be merged back or resharded to another tp with
nothing else at hand, one tensor at a time.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.checkpoint import (
    Directory,
    FileInfo,
    GlobalTensor,
    LocalDirectory,
    Piece,
    _read_config,
    files_identity,
)
from reshard.format.selection import selection_shape
from reshard.plan.types import FORMAT
from reshard.rules.manifest import Manifest, Rule

RANK_FILE = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")


def is_shard_dir(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    return path.is_dir() and any(RANK_FILE.fullmatch(p.name) for p in path.iterdir())


def has_rank_files(names: list[str] | None) -> bool:
    return any(RANK_FILE.fullmatch(n) for n in names or ())


class ShardSet:
    """The rank files of one tp in a directory, seen as one checkpoint of global tensors."""

    def __init__(self, root: Path, tp: int, files: list[FileInfo], tensors: dict[str, GlobalTensor],
                 config: dict[str, Any] | None) -> None:
        self.root, self.tp, self.files, self.tensors, self.config = root, tp, files, tensors, config

    @classmethod
    def open(cls, path: str | os.PathLike[str] | Directory, *, tp: int | None = None) -> ShardSet:
        """The rank files in a local directory, or in a `Directory` (a store prefix that can be listed)."""
        files_in = path if hasattr(path, "header") else LocalDirectory(Path(path))
        root = files_in.root
        found: dict[int, dict[int, str]] = {}
        for name in files_in.names() or ():
            m = RANK_FILE.fullmatch(name)
            if m:
                found.setdefault(int(m.group(2)), {})[int(m.group(1))] = name
        if not found:
            raise CheckpointError(f"{root}: no rank-XXXXX-of-YYYYY.safetensors files")
        if tp is None:
            if len(found) > 1:
                raise CheckpointError(f"{root}: rank files of several tp ({sorted(found)}); remove the stale ones")
            tp = next(iter(found))
        ranks = found.get(tp, {})
        missing = sorted(set(range(tp)) - set(ranks))
        if missing:
            raise CheckpointError(f"{root}: tp={tp} but rank files {missing} are missing")
        files: list[FileInfo] = []
        parts: dict[str, list[tuple[int, Piece, dict[str, Any]]]] = {}
        for rank in range(tp):
            info, local = files_in.header(ranks[rank])
            files.append(info)
            desc = _describe(info, rank, tp)
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
        return cls(root, tp, files, tensors, _read_config(files_in))

    def global_tensors(self) -> dict[str, GlobalTensor]:
        return self.tensors

    def identity(self) -> dict[str, Any]:
        return files_identity(self.files)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def manifest(self) -> Manifest:
        """One exact-name rule per tensor, with the kind and options the shards recorded."""
        rules = tuple(Rule(re.escape(t.name), t.kind or "replicate", dict(t.options or {}), regex=True)
                      for t in self.tensors.values())
        return Manifest(rules, False, f"recorded in the tp={self.tp} rank shards of {self.root}")


def _describe(info: FileInfo, rank: int, tp: int) -> dict[str, Any]:
    meta = info.metadata
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{info.path}: not a reshard rank file (metadata format {meta.get('format')!r}, expected {FORMAT!r})")
    if meta.get("tp") != str(tp) or meta.get("rank") != str(rank):
        raise CheckpointError(f"{info.path}: metadata says rank {meta.get('rank')} of tp {meta.get('tp')}, the name says {rank} of {tp}")
    try:
        desc = json.loads(meta["tensors"])
        assert isinstance(desc, dict) and all({"kind", "shape", "select"} <= set(v) for v in desc.values())
    except (KeyError, ValueError, AssertionError, TypeError):
        raise CheckpointError(f"{info.path}: metadata `tensors` is missing or malformed") from None
    return desc

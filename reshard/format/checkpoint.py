"""Safetensors files and checkpoints: read and validate every header before any tensor byte.

`read_header` reads one file's header and validates it (`reshard.format.headers`: the blob's format and
every check a reader could trip on); `Checkpoint.open` does it for a whole HF checkpoint directory
(index.json, model.safetensors, or every *.safetensors file).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from reshard.errors import CheckpointError
from reshard.format.headers import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    encode_header,
    header_bytes_wanted,
    parse_columns,
    parse_header,
)
from reshard.format.selection import full_selection
from reshard.gcpause import paused_gc

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "reshard.json"  # beside rank files: what wrote them, and the sha256 of each
__all__ = ["CONFIG_NAME", "DTYPE_SIZES", "INDEX_NAME", "MANIFEST_NAME", "MAX_HEADER_BYTES", "SINGLE_NAME", "Checkpoint", "Directory",
           "FileInfo", "GlobalTensor", "LocalDirectory", "Piece", "Source", "TensorInfo", "WholeTensors", "whole_infos",
           "encode_header", "files_identity", "header_bytes_wanted", "header_from", "parse_header", "read_header",
           "read_json"]


class TensorInfo(NamedTuple):
    """Where one tensor lives: `start` is its absolute byte offset in `file`. (A named tuple: a
    checkpoint has one per tensor, 100,000 for an MoE model, made from the header's columns at the
    speed of tuples.)"""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


_new_info = partial(tuple.__new__, TensorInfo)  # TensorInfo from a 6-tuple, in C (`_make` is a Python call)


@dataclass(frozen=True)
class Piece:
    """Part of a global tensor stored contiguously in `info`: the global indices `select` (see loaders)."""

    info: TensorInfo
    select: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class GlobalTensor:
    """A tensor as the model sees it, stored as one or more pieces (several for a rank-shard directory).

    `kind` and `options` are what a rank-shard source recorded for it (None for a plain checkpoint).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    kind: str | None = None
    options: dict[str, Any] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class FileInfo:
    """One validated safetensors file and the fields that make up its identity: size and mtime on
    disk, size and ETag (or version) in a store (`version`; then `path` is a `RemotePath`)."""

    path: Path
    size: int
    mtime_ns: int
    header_len: int
    metadata: dict[str, str] = field(default_factory=dict)
    version: str | None = None

    def stat_key(self) -> tuple[int, int | str]:
        return (self.size, self.mtime_ns if self.version is None else self.version)


def header_from(path: Any, head: bytes, *, size: int, mtime_ns: int = 0,
                version: str | None = None) -> tuple[FileInfo, dict[str, TensorInfo]]:
    """Validate the header in `head` (the file's first bytes: the 8-byte length, then the JSON; extra
    bytes are ignored) of a file of `size` bytes; no tensor byte is needed."""
    header_len = header_bytes_wanted(head, size) if len(head) >= 8 else len(head)
    head = head[:header_len]
    _, metadata, cols = parse_columns(head, path=path, file_size=size)
    starts = map(header_len.__add__, cols.begins)
    infos = map(_new_info, zip(cols.names, cols.dtypes, cols.shapes, repeat(path), starts, cols.sizes))
    return FileInfo(path, size, mtime_ns, header_len, metadata, version), dict(zip(cols.names, infos))


def read_header(path: Path) -> tuple[FileInfo, dict[str, TensorInfo]]:
    """Read and validate one safetensors file's header; no tensor byte is read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) == 8 and header_bytes_wanted(head, st.st_size) > 8:
                head += f.read(header_bytes_wanted(head, st.st_size) - 8)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    return header_from(path, head, size=st.st_size, mtime_ns=st.st_mtime_ns)


def files_identity(files: list[FileInfo]) -> dict[str, Any]:
    """What makes a plan stale: file names, sizes and mtimes (ETags or versions for a store)."""
    return {"files": [{"name": f.path.name, "size": f.size,
                       **({"mtime_ns": f.mtime_ns} if f.version is None else {"etag": f.version})} for f in files]}


class Directory(Protocol):
    """Where a checkpoint's files are: a local directory (`LocalDirectory`) or a prefix in a store or
    on an HTTP server (`reshard.io.source.remote_dir.RemoteDirectory`). Names are plain file names."""

    root: Any  # Path, or RemotePath for a store

    def path(self, name: str) -> Any: ...

    def is_file(self, name: str) -> bool: ...

    def names(self) -> list[str] | None:
        """File names directly in it; None where the store cannot list (plain HTTP)."""

    def read_bytes(self, name: str) -> bytes: ...

    def header(self, name: str) -> tuple[FileInfo, dict[str, TensorInfo]]: ...


class LocalDirectory:
    """A checkpoint directory on this machine."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / name

    def is_file(self, name: str) -> bool:
        return (self.root / name).is_file()

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir())

    def read_bytes(self, name: str) -> bytes:
        try:
            return (self.root / name).read_bytes()
        except OSError as e:
            raise CheckpointError(f"{self.root / name}: cannot read: {e.strerror}") from None

    def header(self, name: str) -> tuple[FileInfo, dict[str, TensorInfo]]:
        return read_header(self.root / name)


class Source(Protocol):
    """What a plan reads: a checkpoint, or a directory of rank shards (`reshard.io.source.rank_dir.ShardSet`)."""

    root: Path
    files: list[FileInfo]
    config: dict[str, Any] | None

    def global_tensors(self) -> Mapping[str, GlobalTensor]: ...

    def identity(self) -> dict[str, Any]: ...

    def total_bytes(self) -> int: ...


@dataclass
class Checkpoint:
    """A validated checkpoint: its files, every tensor (in name order) and its config.json."""

    root: Path  # or a RemotePath
    files: list[FileInfo]
    tensors: dict[str, TensorInfo]
    config: dict[str, Any] | None = None

    @classmethod
    @paused_gc()
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a checkpoint directory (model.safetensors, or index.json + files) or one .safetensors file."""
        path = Path(path)
        if path.is_file():
            d = LocalDirectory(path.parent)
            return cls._from_files(d, [path.name], _read_config(d))
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint (expected a directory or a .safetensors file)")
        return cls.from_directory(LocalDirectory(path))

    @classmethod
    @paused_gc()  # (as for every open below: no collector passes over the many new objects)
    def from_directory(cls, d: Directory) -> Checkpoint:
        """A checkpoint from its directory: index.json and the files it names, else model.safetensors,
        else every *.safetensors file (where the directory can be listed)."""
        config = _read_config(d)
        if d.is_file(INDEX_NAME):
            index = d.path(INDEX_NAME)
            weight_map = _read_index(d)
            names = sorted(set(weight_map.values()))
            for fname in names:
                if Path(fname).name != fname or not d.is_file(fname):
                    raise CheckpointError(f"{index}: names file {fname!r}, which is missing from {d.root}")
            files, tensors, found = _headers(d, names)
            ckpt = cls(d.root, files, tensors, config)
            if found == weight_map:
                return ckpt
            for tname, fname in weight_map.items():
                if found.get(tname) != fname:
                    raise CheckpointError(f"{index}: tensor {tname!r} is not in {fname}")
            extra = set(ckpt.tensors) - set(weight_map)
            if extra:
                raise CheckpointError(f"{index}: does not list {len(extra)} tensors found in the files, e.g. {min(extra)!r}")
            return ckpt
        if d.is_file(SINGLE_NAME):
            return cls._from_files(d, [SINGLE_NAME], config)
        listed = d.names()
        found = sorted(n for n in listed or () if n.endswith(".safetensors") and d.is_file(n))
        if not found:
            extra = "" if listed is not None else " (this server cannot list files: only those two names are tried)"
            raise CheckpointError(f"{d.root}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors files{extra}")
        return cls._from_files(d, found, config)

    @classmethod
    def _from_files(cls, d: Directory, names: list[str], config: dict[str, Any] | None) -> Checkpoint:
        files, tensors, _ = _headers(d, names)
        return cls(d.root, files, tensors, config)

    def global_tensors(self) -> WholeTensors:
        """Every tensor as one piece covering all of it (tensors of one shape share the selection)."""
        return WholeTensors(self.tensors)

    def identity(self) -> dict[str, Any]:
        return files_identity(self.files)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class WholeTensors(Mapping[str, GlobalTensor]):
    """A checkpoint's tensors as global tensors of one piece covering all of it, each made when it
    is read (equal to the last, not the same object). `infos` are the `TensorInfo`s behind them, for
    a caller that needs no more than where each tensor lives (`reshard.plan.planner`)."""

    def __init__(self, infos: dict[str, TensorInfo]) -> None:
        self.infos = infos
        self._full: dict[tuple[int, ...], Any] = {}

    def __getitem__(self, name: str) -> GlobalTensor:
        t = self.infos[name]
        select = self._full.get(t.shape)
        if select is None:
            select = self._full[t.shape] = full_selection(t.shape)
        return GlobalTensor(t.name, t.dtype, t.shape, (Piece(t, select),))

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def __contains__(self, name: object) -> bool:
        return name in self.infos


def whole_infos(tensors: Mapping[str, GlobalTensor]) -> dict[str, TensorInfo] | None:
    """The `TensorInfo`s behind `tensors` when it is a `WholeTensors` (every tensor one whole piece), for
    a caller that can skip making each `GlobalTensor`; None for any other mapping."""
    return tensors.infos if isinstance(tensors, WholeTensors) else None


JSON_MAX_BYTES = 64 << 20  # a checkpoint's JSON files (config, index): an index of 10^6 tensors is ~60 MB
JSON_MAX_DEPTH = 64  # transformers' configs nest 3-4 levels


def read_json(d: Directory, name: str) -> Any:
    """A JSON file of directory `d`, parsed (`parse_json`); errors name the file."""
    return parse_json(d.read_bytes(name), str(d.path(name)))


def parse_json(raw: bytes, where: str) -> Any:
    """A checkpoint's JSON file, parsed; `CheckpointError` naming `where` for anything else: not UTF-8 JSON,
    larger than `JSON_MAX_BYTES`, or nested deeper than `JSON_MAX_DEPTH` (nothing downstream recurses
    through an unbounded document)."""
    if len(raw) > JSON_MAX_BYTES:
        raise CheckpointError(f"{where}: {len(raw)} bytes of JSON, more than the {JSON_MAX_BYTES}-byte limit")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except RecursionError:
        obj = None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON: {e}") from None
    stack, deepest = [(obj, 1)], 0
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > JSON_MAX_DEPTH:
            break
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    if obj is None and raw.strip() != b"null" or deepest > JSON_MAX_DEPTH:
        raise CheckpointError(f"{where}: JSON nested deeper than {JSON_MAX_DEPTH} levels; a checkpoint's config "
                              "and index nest a few")
    return obj


def _read_config(d: Directory) -> dict[str, Any] | None:
    if not d.is_file(CONFIG_NAME):
        return None
    obj = read_json(d, CONFIG_NAME)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{d.path(CONFIG_NAME)}: must be a JSON object, got {type(obj).__name__}")
    return obj


def _headers(d: Directory, names: list[str]) -> tuple[list[FileInfo], dict[str, TensorInfo], dict[str, str]]:
    """The files' headers: their FileInfos, every tensor (in name order), and the file name of each."""
    files: list[FileInfo] = []
    tensors: dict[str, TensorInfo] = {}
    found: dict[str, str] = {}
    for name in names:
        info, ts = d.header(name)
        files.append(info)
        if not tensors.keys().isdisjoint(ts):
            tname = next(t for t in ts if t in tensors)
            raise CheckpointError(f"tensor {tname!r} is in both {tensors[tname].file.name} and {name}")
        tensors.update(ts)
        found.update(dict.fromkeys(ts, name))
    return files, {name: tensors[name] for name in sorted(tensors)}, found


def _read_index(d: Directory) -> dict[str, str]:
    obj = read_json(d, INDEX_NAME)
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not set(map(type, wm.values())) <= {str}:  # (JSON keys are strings)
        raise CheckpointError(f"{d.path(INDEX_NAME)}: must be an object with a 'weight_map' of tensor name -> file name")
    return wm

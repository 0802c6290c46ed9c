"""Safetensors headers: read and validate every header before any tensor byte; multi-file checkpoints.

A safetensors file is `u64 little-endian N | N bytes of JSON header | data region`. The header maps
tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data
region) plus an optional `__metadata__` string->string map. `read_header` checks everything a reader
could trip on; `Checkpoint.open` does it for a whole HF checkpoint directory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from reshard.errors import CheckpointError, HeaderError
from reshard.loaders import full_selection

MAX_HEADER_BYTES = 100 * 1000 * 1000
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# safetensors dtype name -> item size in bytes
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: `start` is its absolute byte offset in `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


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


def _fail(path: Path | str, msg: str) -> HeaderError:
    return HeaderError(f"{path}: {msg}")


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"duplicate name {key!r} in the header")
        out[key] = value
    return out


def parse_header(raw: bytes, *, path: Path | str, file_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Validate a complete header blob (8-byte length + JSON); return (tensors, metadata).

    `file_size` is the size of the whole file, so the data region can be checked to end exactly there.
    """
    if len(raw) < 8:
        raise _fail(path, f"file is {len(raw)} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n == 0:
        raise _fail(path, "header length is 0; not a safetensors file")
    if n > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; not a safetensors file?")
    if 8 + n > file_size:
        raise _fail(path, f"header length {n} runs past the end of the {file_size}-byte file (truncated?)")
    if len(raw) < 8 + n:
        raise _fail(path, f"header truncated: {len(raw) - 8} of {n} bytes")
    blob = raw[8 : 8 + n]
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise _fail(path, str(e)) from None
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise _fail(path, f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"header is a JSON {type(obj).__name__}, not an object")
    metadata = obj.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(_is_text(k) and _is_text(v) for k, v in metadata.items()):
        raise _fail(path, "__metadata__ must map strings to strings")
    data_len = file_size - 8 - n
    spans: list[tuple[int, int, str]] = []
    for name, entry in obj.items():
        _check_entry(path, name, entry)
        begin, end = entry["data_offsets"]
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    prev = None
    for begin, end, name in spans:
        if begin < pos:
            raise _fail(path, f"tensor {name!r}: data_offsets [{begin}, {end}] overlap {prev!r} (which ends at {pos})")
        if begin > pos:
            raise _fail(path, f"tensor {name!r}: hole of {begin - pos} bytes before it (data_offsets start at {begin}, expected {pos})")
        pos, prev = end, name
    if pos != data_len:
        if pos > data_len:
            raise _fail(path, f"data region is {data_len} bytes but tensors need {pos} (truncated download?)")
        raise _fail(path, f"{data_len - pos} trailing bytes after the last tensor (data region {data_len}, tensors end at {pos})")
    return obj, metadata


def _is_text(s: Any) -> bool:
    """A str that is valid Unicode (JSON `\\ud800` escapes decode to lone surrogates, which safetensors refuses)."""
    if not isinstance(s, str):
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_entry(path: Path | str, name: str, entry: Any) -> None:
    if "\x00" in name:
        raise _fail(path, f"tensor name {name!r} contains a NUL byte")
    if not _is_text(name):
        raise _fail(path, f"tensor name {name!r} is not valid Unicode (lone surrogate escape)")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _fail(path, f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets; got {entry!r}"[:300])
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise _fail(path, f"tensor {name!r}: unknown dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r}: shape {shape!r} must be a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} must be two non-negative integers [begin, end]")
    numel = math.prod(shape)
    expected = numel * DTYPE_SIZES[dtype]
    if expected > 2**62:
        raise _fail(path, f"tensor {name!r}: shape {shape} is absurdly large ({numel} elements)")
    if offsets[1] - offsets[0] != expected:
        raise _fail(
            path,
            f"tensor {name!r}: {offsets[1] - offsets[0]} bytes in data_offsets {offsets} but shape {shape} x {dtype} needs {expected}",
        )


def encode_header(meta: dict[str, str], entries: list[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    """Header bytes (length prefix included) for (name, dtype, shape, begin, end) entries, padded to 8."""
    header: dict[str, Any] = {"__metadata__": meta}
    for name, dtype, shape, begin, end in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def header_bytes_wanted(head: bytes, file_size: int) -> int:
    """How many bytes from the start of the file the header needs, given its first bytes (at least 8):
    8 + N when N is plausible, else 8 (then `parse_header` says what is wrong)."""
    (n,) = struct.unpack("<Q", head[:8])
    return 8 + n if 0 < n <= MAX_HEADER_BYTES and 8 + n <= file_size else 8


def header_from(path: Any, head: bytes, *, size: int, mtime_ns: int = 0,
                version: str | None = None) -> tuple[FileInfo, dict[str, TensorInfo]]:
    """Validate the header in `head` (the file's first bytes: the 8-byte length, then the JSON; extra
    bytes are ignored) of a file of `size` bytes; no tensor byte is needed."""
    header_len = header_bytes_wanted(head, size) if len(head) >= 8 else len(head)
    head = head[:header_len]
    entries, metadata = parse_header(head, path=path, file_size=size)
    tensors = {
        name: TensorInfo(name, e["dtype"], tuple(e["shape"]), path, header_len + e["data_offsets"][0],
                         e["data_offsets"][1] - e["data_offsets"][0])
        for name, e in entries.items()
    }
    return FileInfo(path, size, mtime_ns, header_len, metadata, version), tensors


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
    on an HTTP server (`reshard.sources.remote.RemoteDirectory`). Names are plain file names."""

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
    """What a plan reads: a checkpoint, or a directory of rank shards (`reshard.shards.ShardSet`)."""

    root: Path
    files: list[FileInfo]
    config: dict[str, Any] | None

    def global_tensors(self) -> dict[str, GlobalTensor]: ...

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
            ckpt = cls._from_files(d, names, config)
            for tname, fname in weight_map.items():
                info = ckpt.tensors.get(tname)
                if info is None or info.file.name != fname:
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
        files: list[FileInfo] = []
        tensors: dict[str, TensorInfo] = {}
        for name in names:
            info, ts = d.header(name)
            files.append(info)
            for tname, t in ts.items():
                if tname in tensors:
                    raise CheckpointError(f"tensor {tname!r} is in both {tensors[tname].file.name} and {name}")
                tensors[tname] = t
        return cls(d.root, files, dict(sorted(tensors.items())), config)

    def global_tensors(self) -> dict[str, GlobalTensor]:
        """Every tensor as one piece covering all of it (tensors of one shape share the selection)."""
        full: dict[tuple[int, ...], Any] = {}
        out = {}
        for name, t in self.tensors.items():
            sel = full.get(t.shape)
            if sel is None:
                sel = full[t.shape] = full_selection(t.shape)
            out[name] = GlobalTensor(name, t.dtype, t.shape, (Piece(t, sel),))
        return out

    def identity(self) -> dict[str, Any]:
        return files_identity(self.files)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_json(d: Directory, name: str) -> Any:
    """A JSON file of directory `d`, parsed; errors name the file."""
    try:
        return json.loads(d.read_bytes(name).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{d.path(name)}: not valid JSON: {e}") from None


def _read_config(d: Directory) -> dict[str, Any] | None:
    if not d.is_file(CONFIG_NAME):
        return None
    obj = read_json(d, CONFIG_NAME)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{d.path(CONFIG_NAME)}: must be a JSON object, got {type(obj).__name__}")
    return obj


def _read_index(d: Directory) -> dict[str, str]:
    obj = read_json(d, INDEX_NAME)
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{d.path(INDEX_NAME)}: must be an object with a 'weight_map' of tensor name -> file name")
    return wm

"""torch DCP's `.metadata` file, read without running it: what a `dcp.save` checkpoint holds and where.

`torch.distributed.checkpoint.save` (FileSystemWriter, as torchtitan's `step-N/` folders are made) writes
`__R_N.distcp` files and one `.metadata`: a pickle of `Metadata` with, per tensor, its dtype, global size
and the chunks (offsets, sizes) the ranks saved; per chunk (`storage_data`, keyed by name and offsets)
the file, byte offset and length of the item that holds it and the transforms applied to it
(compression); `planner_data`: each flattened name's path in the saved dict (`("model", "lm_head.weight")`
for `dcp.save({"model": sd})`); and the version. Non-tensor entries (`BytesStorageMetadata`: a step
counter, a data loader's state) are named in `objects`.

`read_metadata(blob, where=)` admits only DCP's metadata classes, torch's dtypes, `torch.Size`, the
layout and memory-format encodings, paths and plain containers (`reshard.format.safe_pickle`): a
`.metadata` that names anything else is refused before any of it runs. What it gives back is plain,
validated values (`DcpMetadata`), safetensors dtype names included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.safe_pickle import Record, record_class, restricted_loads

__all__ = ["METADATA_NAME", "MAX_METADATA_BYTES", "TORCH_DTYPES", "DcpChunk", "DcpItem", "DcpMetadata", "DcpTensor",
           "read_metadata", "torch_dtype_names"]

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 2 << 30
# torch dtype name -> safetensors dtype name (those safetensors has)
TORCH_DTYPES: dict[str, str] = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0", "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64",
}
_OTHER_DTYPES = ("complex128", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2", "qint8", "quint8",
                 "qint32", "quint4x2", "quint2x4", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,255}")


class _Dtype(str):
    """A torch dtype, by its name (`torch.bfloat16` -> "bfloat16")."""


def torch_dtype_names() -> dict[tuple[str, str], Any]:
    """`("torch", NAME) -> _Dtype(NAME)` for every torch dtype name, for a restricted unpickler."""
    return {("torch", n): _Dtype(n) for n in (*TORCH_DTYPES, *_OTHER_DTYPES)}


_DCP = "torch.distributed.checkpoint.metadata"
_CLASSES = {n: record_class(n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                                         "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_StorageInfo")}


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("a path of non-strings")
    return "/".join(parts)


def _checked_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


_ALLOWED: dict[tuple[str, str], Any] = {
    **{(_DCP, n): c for n, c in _CLASSES.items() if n != "_StorageInfo"},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _CLASSES["_StorageInfo"],
    (_DCP, "_MEM_FORMAT_ENCODING"): int,
    ("torch.serialization", "_get_layout"): _checked_str,
    ("torch", "strided"): "torch.strided",  # how older torch pickled the properties' layout and memory format
    **{("torch._utils", f"torch.{n}"): n for n in ("contiguous_format", "channels_last", "preserve_format")},
    ("torch", "Size"): tuple,
    ("collections", "OrderedDict"): dict,
    **{("pathlib", n): _path for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
    **torch_dtype_names(),
}


@dataclass(frozen=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class DcpTensor:
    """A tensor of the saved state dict: safetensors `dtype`, global `shape`, the chunks saved."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpItem:
    """Where one chunk is: `length` bytes at `offset` of file `file`, written through `transforms`."""

    fqn: str
    offsets: tuple[int, ...]
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpMetadata:
    tensors: dict[str, DcpTensor]
    items: dict[tuple[str, tuple[int, ...]], DcpItem]
    paths: dict[str, tuple[Any, ...]]  # planner_data: flattened name -> path in the saved dict (may be empty)
    objects: tuple[str, ...]  # non-tensor entries
    version: str | None


def read_metadata(blob: bytes, *, where: str) -> DcpMetadata:
    """The `.metadata` pickle `blob` (the file `where`), read with the restricted unpickler and validated."""
    if len(blob) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where}: {len(blob)} bytes, more than the {MAX_METADATA_BYTES} a DCP .metadata may have here")
    md = restricted_loads(blob, _ALLOWED, where=where, what="DCP .metadata")
    try:
        return _validated(md)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise CheckpointError(f"{where}: not a DCP .metadata torch writes: {e}") from None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} {value!r} is not a list of non-negative integers")
    return tuple(value)


def _is(obj: Any, name: str) -> bool:
    return isinstance(obj, _CLASSES[name])


def _validated(md: Any) -> DcpMetadata:
    if not _is(md, "Metadata") or not isinstance(md.state_dict_metadata, dict):
        raise ValueError("no Metadata with a state_dict_metadata at its top")
    tensors: dict[str, DcpTensor] = {}
    objects = []
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise ValueError(f"state_dict_metadata key {fqn!r} is not a string")
        if _is(entry, "BytesStorageMetadata"):
            objects.append(fqn)
            continue
        if not _is(entry, "TensorStorageMetadata"):
            raise ValueError(f"{fqn!r}: {entry!r} is neither a tensor's nor a bytes entry's metadata")
        tensors[fqn] = _tensor(fqn, entry)
    items = {}
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise ValueError("storage_data is not a dict of MetadataIndex -> _StorageInfo")
    for index, info in storage.items():
        if not _is(index, "MetadataIndex") or not _is(info, "_StorageInfo") or not isinstance(index.fqn, str):
            raise ValueError(f"storage_data entry {index!r}: {info!r} is not a MetadataIndex -> _StorageInfo")
        if index.fqn not in tensors:
            continue  # a non-tensor entry's bytes
        offsets = _ints(getattr(index, "offset", None), f"{index.fqn!r}: offset")
        file, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(file, str) or not _FILE_NAME.fullmatch(file) or file in (".", ".."):
            raise ValueError(f"{index.fqn!r}: file {file!r} is not a plain file name beside .metadata")
        _ints([offset, length], f"{index.fqn!r}: offset and length")
        transforms = getattr(info, "transform_descriptors", None) or ()
        if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
            raise ValueError(f"{index.fqn!r}: transform_descriptors {transforms!r} are not strings")
        items[(index.fqn, offsets)] = DcpItem(index.fqn, offsets, file, offset, length, tuple(transforms))
    for t in tensors.values():
        for c in t.chunks:
            if (t.fqn, c.offsets) not in items:
                raise ValueError(f"tensor {t.fqn!r}: no storage_data entry for its chunk at {list(c.offsets)}")
    paths = getattr(md, "planner_data", None)
    paths = {k: tuple(v) for k, v in paths.items() if isinstance(v, (tuple, list))} if isinstance(paths, dict) else {}
    version = getattr(md, "version", None)
    return DcpMetadata(tensors, items, paths, tuple(objects), version if isinstance(version, str) else None)


def _tensor(fqn: str, entry: Record) -> DcpTensor:
    props = entry.properties
    state = props.state if _is(props, "TensorProperties") and isinstance(props.state, tuple) else None
    dtype = state[0] if state else getattr(props, "dtype", None)
    if not isinstance(dtype, _Dtype):
        raise ValueError(f"{fqn!r}: no dtype in its properties")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"{fqn!r}: dtype torch.{dtype} has no safetensors equivalent")
    if state and state[1] != "torch.strided":
        raise ValueError(f"{fqn!r}: layout {state[1]} (only torch.strided tensors are read)")
    shape = _ints(entry.size, f"{fqn!r}: size")
    chunks = []
    for c in entry.chunks:
        if not _is(c, "ChunkStorageMetadata"):
            raise ValueError(f"{fqn!r}: chunk {c!r} is not a ChunkStorageMetadata")
        offsets, sizes = _ints(c.offsets, f"{fqn!r}: chunk offsets"), _ints(c.sizes, f"{fqn!r}: chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise ValueError(f"{fqn!r}: chunk at {list(offsets)} of size {list(sizes)} is outside its size {list(shape)}")
        chunks.append(DcpChunk(offsets, sizes))
    return DcpTensor(fqn, TORCH_DTYPES[dtype], shape, tuple(chunks))


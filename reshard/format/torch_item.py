"""One tensor written by `torch.save`, as DCP's FileSystemWriter stores each chunk: where its raw bytes are.

`torch.save(tensor, stream)` writes a zip archive (entries stored, not compressed): `ARCHIVE/data.pkl`, a
pickle that rebuilds the tensor (`torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
...)`, or `_v3` with the dtype for dtypes without a typed storage class) whose storage is a persistent
id `("storage", STORAGE_CLASS, KEY, LOCATION, NUMEL)`; the storage's bytes are entry `ARCHIVE/data/KEY`;
then small entries (version, byte order, alignment). Local headers carry no sizes (a data descriptor
follows each entry), so entries are found through the central directory at the archive's end.

`locate_tensor(read, length, where=, dtype=, shape=)` finds, within an item of `length` bytes (`read(a,
b)` gives bytes [a, b) of the item), the offset of the tensor's first byte, after checking that the
pickle holds one plain row-major tensor of that dtype and shape over that storage (the pickle is read by
`reshard.format.safe_pickle`: nothing in it runs). `HEAD` and `TAIL` bytes of an item are what it
reads in a typical item, so a caller can fetch those ahead.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.dcp_metadata import TORCH_DTYPES, torch_dtype_names
from reshard.format.headers import DTYPE_SIZES
from reshard.format.safe_pickle import record_class, restricted_loads

__all__ = ["HEAD", "TAIL", "locate_tensor"]

HEAD = 4096  # data.pkl and the storage entry's local header are in an item's first few hundred bytes
TAIL = 4096  # the central directory and end records of a tensor's archive, with room to spare
_EOCD, _EOCD64, _LOCATOR, _CENTRAL, _LOCAL = 0x06054B50, 0x06064B50, 0x07064B50, 0x02014B50, 0x04034B50
_MAX_ENTRIES = 64
_STORAGES = {  # torch's typed storage classes -> safetensors dtype (NUMEL counts elements)
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
    "BoolStorage": "BOOL", "ComplexFloatStorage": "C64",
}
_Rebuilt = record_class("Tensor")
_Storage = record_class("Storage")


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
    return _Rebuilt(storage=storage, offset=offset, size=size, stride=stride, dtype=None)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                *rest: Any) -> Any:
    return _Rebuilt(storage=storage, offset=offset, size=size, stride=stride, dtype=dtype)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): "UntypedStorage",
    **{("torch", n): n for n in _STORAGES},
    ("collections", "OrderedDict"): dict,
    ("torch", "Size"): tuple,
    **torch_dtype_names(),
}


def _persistent(pid: Any) -> Any:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], str)
            and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
        raise ValueError(f"persistent id {str(pid)[:80]} is not a storage")
    return _Storage(kind=pid[1], key=pid[2], numel=pid[4])


def _u16(b: bytes, at: int) -> int:
    return struct.unpack_from("<H", b, at)[0]


def _u32(b: bytes, at: int) -> int:
    return struct.unpack_from("<I", b, at)[0]


def _u64(b: bytes, at: int) -> int:
    return struct.unpack_from("<Q", b, at)[0]


def _central(read: Callable[[int, int], bytes], length: int) -> dict[str, tuple[int, int, int]]:
    """name -> (local header offset, stored size, compression method) from the central directory."""
    tail_at = max(0, length - TAIL)
    tail = read(tail_at, length)
    at = tail.rfind(struct.pack("<I", _EOCD), 0, max(0, len(tail) - 18))  # the record is 22 bytes
    if at < 0:
        raise ValueError("no zip end record (not a torch.save archive)")
    count, cd_size, cd_at = _u16(tail, at + 10), _u32(tail, at + 12), _u32(tail, at + 16)
    if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_at):
        loc = at - 20
        if loc < 0 or _u32(tail, loc) != _LOCATOR:
            raise ValueError("zip64 sizes without a zip64 locator")
        rec = _u64(tail, loc + 8) - tail_at
        if rec < 0 or _u32(tail, rec) != _EOCD64:
            raise ValueError("no zip64 end record where its locator points")
        count, cd_size, cd_at = _u64(tail, rec + 32), _u64(tail, rec + 40), _u64(tail, rec + 48)
    if count > _MAX_ENTRIES or cd_at + cd_size > length:
        raise ValueError(f"a central directory of {count} entries at {cd_at} (+{cd_size}) in {length} bytes")
    cd = tail[cd_at - tail_at : cd_at - tail_at + cd_size] if cd_at >= tail_at else read(cd_at, cd_at + cd_size)
    out, pos = {}, 0
    for _ in range(count):
        if _u32(cd, pos) != _CENTRAL:
            raise ValueError("a broken central directory")
        method, csize, usize = _u16(cd, pos + 10), _u32(cd, pos + 20), _u32(cd, pos + 24)
        nlen, xlen, clen, local = _u16(cd, pos + 28), _u16(cd, pos + 30), _u16(cd, pos + 32), _u32(cd, pos + 42)
        name = cd[pos + 46 : pos + 46 + nlen].decode("utf-8")
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + xlen]
        if 0xFFFFFFFF in (csize, usize, local):
            csize, usize, local = _zip64_extra(extra, csize, usize, local)
        out[name] = (local, csize, method)
        pos += 46 + nlen + xlen + clen
    return out


def _zip64_extra(extra: bytes, csize: int, usize: int, local: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = _u16(extra, pos), _u16(extra, pos + 2)
        if tag == 1:
            vals, at = [], pos + 4
            for v in (usize, csize, local):
                if v == 0xFFFFFFFF:
                    vals.append(_u64(extra, at))
                    at += 8
                else:
                    vals.append(v)
            return vals[1], vals[0], vals[2]
        pos += 4 + size
    raise ValueError("zip64 sizes without a zip64 extra field")


def _data_start(read: Callable[[int, int], bytes], local: int, name: str) -> int:
    head = read(local, local + 30)
    if len(head) < 30 or _u32(head, 0) != _LOCAL:
        raise ValueError(f"no local header for {name} at {local}")
    return local + 30 + _u16(head, 26) + _u16(head, 28)


def locate_tensor(read: Callable[[int, int], bytes], length: int, *, where: str, dtype: str,
                  shape: tuple[int, ...]) -> int:
    """Offset, within the item, of the first byte of the row-major tensor of `dtype` and `shape` it holds."""
    try:
        entries = _central(read, length)
        pkl = [n for n in entries if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise ValueError(f"{len(pkl)} data.pkl entries")
        archive = pkl[0][: -len("data.pkl")]
        local, size, method = entries[pkl[0]]
        if method != 0:
            raise ValueError(f"data.pkl is compressed (zip method {method})")
        start = _data_start(read, local, pkl[0])
        blob = read(start, start + size)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not a tensor saved by torch.save: {e}") from None
    t = restricted_loads(blob, _ALLOWED, where=where, what="torch.save tensor pickle", persistent=_persistent)
    try:
        return _check(read, t, entries, archive, where, dtype, shape)
    except (ValueError, struct.error) as e:
        raise CheckpointError(f"{where}: {e}") from None


def _check(read: Callable[[int, int], bytes], t: Any, entries: dict[str, tuple[int, int, int]], archive: str,
           where: str, dtype: str, shape: tuple[int, ...]) -> int:
    if not isinstance(t, _Rebuilt) or not isinstance(t.storage, _Storage):
        raise ValueError(f"holds {type(t).__name__}, not a plain tensor")
    kind, numel = t.storage.kind, t.storage.numel
    got = _STORAGES.get(kind) if t.dtype is None else TORCH_DTYPES.get(t.dtype)
    if got != dtype:
        raise ValueError(f"holds a tensor of {t.dtype or kind}, but the metadata says {dtype}")
    storage_bytes = numel if kind == "UntypedStorage" else numel * DTYPE_SIZES[dtype]
    size, stride, offset = tuple(t.size), tuple(t.stride), t.offset
    if size != shape:
        raise ValueError(f"holds a tensor of shape {list(size)}, but the metadata says {list(shape)}")
    row_major = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    if math.prod(shape) and any(n > 1 and s != r for n, s, r in zip(shape, stride, row_major)):
        raise ValueError(f"holds a tensor of strides {list(stride)}, not row-major {row_major} (a transposed view); "
                         "reshard reads row-major tensors: save `t.contiguous()`")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if type(offset) is not int or offset < 0 or offset * DTYPE_SIZES[dtype] + nbytes > storage_bytes:
        raise ValueError(f"its tensor (offset {offset}, {nbytes} bytes) does not fit its storage of {storage_bytes} bytes")
    entry = entries.get(f"{archive}data/{t.storage.key}")
    if entry is None:
        raise ValueError(f"no entry data/{t.storage.key} for its storage")
    local, stored, method = entry
    if method != 0 or stored != storage_bytes:
        raise ValueError(f"its storage entry is {stored} bytes (method {method}), not {storage_bytes} stored bytes")
    return _data_start(read, local, f"data/{t.storage.key}") + offset * DTYPE_SIZES[dtype]

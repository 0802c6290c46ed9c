"""Safetensors header blobs: the 8-byte length, the JSON, and everything a reader could trip on.

A safetensors file is `u64 little-endian N | N bytes of JSON header | data region`. The header maps
tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data
region) plus an optional `__metadata__` string->string map. `parse_header` refuses any header whose
entries are malformed or whose data offsets do not tile the data region exactly, naming the file, the
tensor and the numbers.

A checkpoint of 100,000 tensors needs this fast, so there are three readers, tried in turn:
`_canonical_parse` reads a header as safetensors writes it (compact JSON, keys in its order) with one
regex over the entries; `_fast_parse` takes any JSON with `json.loads` and checks the entries a field
at a time (`_fast_columns`: set and map operations, shapes and sizes once per distinct dtype, shape
and size); both only ever accept, and give None on any doubt. Then the per-entry checks
(`check_entries`) run and name the first problem, so the errors are theirs, word for word (tests
compare all three readers on fuzzed headers).
"""

from __future__ import annotations

import json
import math
import operator
import re
import struct
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

from reshard.errors import HeaderError

MAX_HEADER_BYTES = 100 * 1000 * 1000

# safetensors dtype name -> item size in bytes
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
# safetensors' `Dtype` enum order: a file it writes holds its data in descending order of it, then by name
# (U8 weights and F8_E4M3 scales of the same item size: the scales first)
DTYPE_RANK: dict[str, int] = {name: i for i, name in enumerate((
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "C64", "F64", "I64", "U64"))}


def _fail(path: Path | str, msg: str) -> HeaderError:
    return HeaderError(f"{path}: {msg}")


class _Duplicate(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    return out if len(out) == len(pairs) else _no_duplicates(pairs)


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
    entries, metadata, cols = parse_columns(raw, path=path, file_size=file_size)
    if entries is None:  # read without JSON objects: the dict json.loads gives
        entries = {name: {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + size]}
                   for name, dtype, shape, begin, size in zip(*cols)}
    return entries, metadata


class Columns(NamedTuple):
    """Every entry of a validated header, a field at a time, in header order."""

    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[tuple[int, ...]]
    begins: Sequence[int]
    sizes: Sequence[int]


def parse_columns(raw: bytes, *, path: Path | str, file_size: int
                  ) -> tuple[dict[str, Any] | None, dict[str, str], Columns]:
    """`parse_header`, with every entry's fields a column at a time (what `format.header_from` builds
    its `TensorInfo`s from); the entries' dict is None where the header was read without it."""
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
    data_len = file_size - 8 - n
    fast = _canonical_parse(text, data_len) or _fast_parse(text, data_len)
    if fast is not None:
        return fast
    # something may be wrong: parsed again, every check in turn, the first problem named
    try:
        obj = json.loads(text, object_pairs_hook=_unique_pairs)
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
    check_entries(path, obj, data_len)
    return obj, metadata, _columns(obj)


def _fast_parse(text: str, data_len: int) -> tuple[dict[str, Any], dict[str, str], Columns] | None:
    """What `parse_columns` returns for a header that passes every check, found without a Python
    call per JSON object; None when something may be wrong (then the checks run one by one)."""
    try:
        obj = json.loads(text)  # repeated keys: the last value kept, counted below
    except (ValueError, RecursionError):
        return None
    if type(obj) is not dict:
        return None
    pairs = len(obj)
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif type(metadata) is not dict or not all(_is_text(k) and _is_text(v) for k, v in metadata.items()):
        return None
    columns = _fast_columns(text, obj, data_len)
    # Every ':' outside a string separates a key from its value. With the structure now checked
    # (entries of three keys, lists of ints, string metadata) the text has exactly this many, unless
    # a key was repeated (json.loads kept one) or a string holds a ':' (then it has more).
    if columns is None or text.count(":") != pairs + len(metadata) + 3 * len(obj):
        return None
    return obj, metadata, columns


def check_entries(path: Path | str, entries: dict[str, Any], data_len: int) -> None:
    """Check every tensor entry on its own, then that their data offsets tile the `data_len`-byte
    data region; raise `HeaderError` naming the first problem (what `parse_header` reports)."""
    spans: list[tuple[int, int, str]] = []
    for name, entry in entries.items():
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


def _columns(entries: dict[str, Any]) -> Columns:
    """The columns of entries `check_entries` accepted."""
    values = entries.values()
    return Columns(list(entries), [e["dtype"] for e in values], [tuple(e["shape"]) for e in values],
                    [e["data_offsets"][0] for e in values], [e["data_offsets"][1] - e["data_offsets"][0] for e in values])


_FIELDS = operator.itemgetter("dtype", "shape", "data_offsets")


def _fast_columns(text: str, entries: dict[str, Any], data_len: int) -> Columns | None:
    """The columns when every entry passes `check_entries`, found a field at a time (each check of
    `_check_entry` over all entries at once, shapes and sizes once per distinct dtype and shape);
    None when some entry might not (then `check_entries` decides, and says what is wrong)."""
    if not entries or "\\u" in text:  # a \u escape is the only way a name can hold a NUL or a lone surrogate
        return None
    values = entries.values()
    try:
        dtypes, shapes, offsets = zip(*map(_FIELDS, values))  # KeyError, TypeError: a field or a dict missing
        if (set(map(len, values)) != {3} or not set(dtypes) <= DTYPE_SIZES.keys()
                or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}):
            return None
        begins, ends = zip(*offsets)
        if set(map(type, begins)) != {int} or set(map(type, ends)) != {int} or min(begins) < 0:
            return None
        return _checked(list(entries), dtypes, list(map(tuple, shapes)), begins, ends, data_len)
    except (KeyError, TypeError):  # TypeError: an unhashable dtype or dimension
        return None


def _checked(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[tuple[Any, ...]], begins: Sequence[int],
             ends: Sequence[int], data_len: int) -> Columns | None:
    """The columns if every shape is of non-negative integers, every size is what its shape and dtype
    need (at most 2**62 bytes) and the spans tile the data region; else None. (Names, dtypes and the
    offsets' types are checked already.)"""
    sizes = list(map(operator.sub, ends, begins))
    for dtype, shape, size in set(zip(dtypes, shapes, sizes)):
        if not all(type(d) is int and d >= 0 for d in shape) or size != math.prod(shape) * DTYPE_SIZES[dtype]:
            return None
        if size > 2**62:
            return None
    if not _tiles(begins, ends, data_len):  # not in file order: in begin order, as check_entries does
        spans = sorted(zip(begins, ends))
        if not _tiles([b for b, _ in spans], [e for _, e in spans], data_len):
            return None
    return Columns(names, dtypes, shapes, begins, sizes)


# Headers as safetensors writes them: compact JSON, the metadata first, each entry's keys in the order
# dtype, shape, data_offsets, then spaces. One regex reads the entries' fields as strings.
_ENTRY = re.compile(r'"([^"]*)":\{"dtype":"([A-Z0-9_]+)","shape":\[([0-9,]*)\],"data_offsets":\[([0-9]+),([0-9]+)\]\}(,?)')
_NUM = "(?:0|[1-9][0-9]*)"  # a JSON integer that is not negative (no 01)
_DIMS = re.compile(rf"(?:{_NUM}(?:,{_NUM})*)?")
_PRINTABLE = bytes(range(0x20, 0x7F))
_ENTRY_CHARS = len('"":{"dtype":"","shape":[],"data_offsets":[,]}')  # an entry's characters outside its fields
_METADATA = json.JSONDecoder(object_pairs_hook=_unique_pairs)


def _canonical_parse(text: str, data_len: int) -> tuple[None, dict[str, str], Columns] | None:
    """What `parse_columns` returns for a header as safetensors writes it that passes every check,
    read with one regex over its entries (their names hold no escape and no control character: the
    text is the name); None for any other header (then `_fast_parse` decides)."""
    body = text.rstrip(" ")
    if not (body.startswith("{") and body.endswith("}")):
        return None
    pos, metadata = 1, {}
    if body.startswith('"__metadata__":', 1):
        try:
            metadata, pos = _METADATA.raw_decode(body, 16)
        except (ValueError, RecursionError, _Duplicate):
            return None
        if type(metadata) is not dict or not all(_is_text(k) and _is_text(v) for k, v in metadata.items()):
            return None
        if body[pos : pos + 1] != ",":
            return None
        pos += 1
    entries = body[pos:-1]
    if "\\" in entries:  # an escape: a name is not its text
        return None
    rows = _ENTRY.findall(entries)
    if not rows:
        return None
    names, dtypes, shapes, begins, ends, commas = zip(*rows)
    n = len(rows)
    # the matches (found left to right, apart) are the whole text when their lengths add up to its
    # length, every one but the last ending with a comma
    if commas[-1] or commas.count(",") != n - 1 or len(entries) != (
            sum(map(len, chain(names, dtypes, shapes, begins, ends))) + _ENTRY_CHARS * n + n - 1):
        return None
    if "__metadata__" in names or len(set(names)) != n or not set(dtypes) <= DTYPE_SIZES.keys():
        return None
    text_names = "".join(names)  # the only fields a control character (not allowed in JSON) could be in
    if not (text_names.encode("ascii").translate(None, _PRINTABLE) == b"" if text_names.isascii()
            else text_names.isprintable()):
        return None
    dims = {s: tuple(map(int, s.split(","))) if s else () for s in set(shapes) if _DIMS.fullmatch(s)}
    starts, stops = list(map(int, begins)), list(map(int, ends))
    if len(dims) != len(set(shapes)) or sum(map(len, chain(begins, ends))) != sum(map(len, map(str, chain(starts, stops)))):
        return None  # a shape like [1,,2], a number like 01 (longer than the int's own digits)
    cols = _checked(names, dtypes, list(map(dims.__getitem__, shapes)), starts, stops, data_len)
    return None if cols is None else (None, metadata, cols)


def _tiles(begins: Sequence[int], ends: Sequence[int], data_len: int) -> bool:
    """Each span starts where the one before ends, the first at 0, the last ends at `data_len`."""
    return begins[0] == 0 and begins[1:] == ends[:-1] and ends[-1] == data_len


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
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
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



"""Fuzz `reshard.format.parse_header`: any bytes are parsed or refused with ReshardError, nothing else.

And whatever reshard accepts, the safetensors library reads too, with the same names, dtypes and
shapes (reshard may be stricter, never looser).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from bench.moe_data import moe_checkpoint
from reshard import headers
from reshard.errors import ReshardError
from reshard.format import DTYPE_SIZES, parse_header, read_header

from .helpers import raw_safetensors

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
TORCH_OK = ["F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F64", "F8_E4M3", "F8_E5M2"]


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "f.safetensors"


def parse_or_refuse(raw: bytes, file_size: int | None = None) -> tuple[dict, dict] | None:
    """parse_header's result, or None when it refused with a ReshardError (any other exception fails)."""
    try:
        return parse_header(raw, path="fuzz.safetensors", file_size=len(raw) if file_size is None else file_size)
    except ReshardError:
        return None


@st.composite
def valid_files(draw: st.DrawFn) -> bytes:
    """A well-formed safetensors file: a few tensors of small shapes, contiguous, optional metadata."""
    names = draw(st.lists(st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__" and "\0" not in s),
                          min_size=0, max_size=4, unique=True))
    header: dict = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
    pos = 0
    for name in names:
        dtype = draw(st.sampled_from(TORCH_OK))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    return raw_safetensors(header, draw(st.binary(min_size=pos, max_size=pos)))


@st.composite
def mutated_files(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(valid_files()))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete", "length", "token"]))
        i = draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del raw[i:]
        elif op == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del raw[i : i + draw(st.integers(1, 4))]
        elif op == "length" and len(raw) >= 8:
            raw[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
        elif op == "token" and len(raw) > 8:
            token = draw(st.sampled_from([b'"', b"{", b"}", b"[", b"]", b",", b":", b"-1", b"1e400", b"null",
                                          b'"\\ud800"', b"\\u0000", b"NaN", b"99999999999999999999", b"0"]))
            j = draw(st.integers(8, len(raw) - 1))
            raw[j : j + len(token)] = token
    return bytes(raw)


def check_agrees_with_safetensors(raw: bytes, path: Path) -> None:
    """If reshard accepts `raw` as a file, safetensors opens it and sees the same tensors."""
    parsed = parse_or_refuse(raw)
    if parsed is None:
        return
    entries, _ = parsed
    path.write_bytes(raw)
    info, tensors = read_header(path)
    assert info.size == len(raw) and set(tensors) == set(entries)
    assert all(info.header_len <= t.start and t.start + t.nbytes <= len(raw) for t in tensors.values())
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(entries)
        for name, e in entries.items():
            sl = f.get_slice(name)
            assert (sl.get_dtype(), list(sl.get_shape())) == (e["dtype"], e["shape"]), name


@FUZZ
@given(st.binary(max_size=400), st.one_of(st.none(), st.integers(0, 2**40)))
def test_any_bytes_parse_or_refuse(raw: bytes, file_size: int | None) -> None:
    parse_or_refuse(raw, file_size)


DEEP = st.builds(lambda n, c: c * n, st.integers(1, 100_000), st.sampled_from([b"[", b'{"a":', b'{"a":[']))


@FUZZ
@given(st.one_of(st.binary(max_size=200), DEEP))
def test_any_header_text_with_a_correct_length(fuzz_file: Path, blob: bytes) -> None:
    """Random header bytes (or deep nesting) behind a length prefix that fits: the JSON layer is reached."""
    check_agrees_with_safetensors(raw_safetensors(blob), fuzz_file)


@FUZZ
@given(valid_files())
def test_valid_files_are_accepted_like_safetensors(fuzz_file: Path, raw: bytes) -> None:
    assert parse_or_refuse(raw) is not None
    check_agrees_with_safetensors(raw, fuzz_file)


@FUZZ
@given(mutated_files())
def test_mutated_files_parse_or_refuse_and_agree_with_safetensors(fuzz_file: Path, raw: bytes) -> None:
    check_agrees_with_safetensors(raw, fuzz_file)


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda children: st.lists(children, max_size=3)
                    | st.dictionaries(st.text(max_size=5), children, max_size=3), max_leaves=12))
def test_any_json_value_as_header(fuzz_file: Path, value: object) -> None:
    blob = json.dumps(value).encode()
    check_agrees_with_safetensors(raw_safetensors(blob, b"\0" * 8), fuzz_file)
    if isinstance(value, dict):
        check_agrees_with_safetensors(raw_safetensors(json.dumps({"t": value}).encode()), fuzz_file)
    check_agrees_with_safetensors(raw_safetensors(json.dumps({"__metadata__": value}).encode()), fuzz_file)


# --- the column-at-a-time checks decide as the per-entry checks do -------------------------------------

def outcome(raw: bytes, *, fast: bool) -> object:
    """parse_columns' result, or the message it refused with; `fast=False` turns off its fast path
    (`headers._fast_parse`), so every check runs one entry at a time as before it existed."""
    saved = headers._fast_parse
    if not fast:
        headers._fast_parse = lambda text, data_len: None  # type: ignore[assignment]
    try:
        entries, metadata, columns = headers.parse_columns(raw, path="f.safetensors", file_size=len(raw))
        return entries, metadata, tuple(map(list, columns))
    except ReshardError as e:
        return str(e)
    finally:
        headers._fast_parse = saved  # type: ignore[assignment]


ASCII_NAMES = st.text(st.sampled_from("abc.:_-09\"\\"), min_size=1, max_size=6)


@st.composite
def canonical_files(draw: st.DrawFn) -> bytes:
    """Files as safetensors writes them (compact JSON, ASCII names, offsets in order): the fast path's
    home ground; then up to two mutations of their bytes."""
    names = draw(st.lists(ASCII_NAMES.filter(lambda s: s != "__metadata__"), min_size=1, max_size=5, unique=True))
    header: dict = {"__metadata__": {"format": "pt"}} if draw(st.booleans()) else {}
    pos = 0
    for name in names:
        dtype = draw(st.sampled_from(TORCH_OK))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        n = DTYPE_SIZES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if draw(st.booleans()):  # not in offset order
        header = dict(sorted(header.items(), reverse=True))
    text = json.dumps(header, separators=(",", ":"))
    if draw(st.booleans()):  # a name given twice (json.loads alone would keep the second)
        first = json.dumps(dict([next(iter(header.items()))]), separators=(",", ":"))[1:-1]
        text = text[:-1] + "," + first + "}"
    raw = bytearray(raw_safetensors(text.encode(), bytes(pos)))
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(8, len(raw) - 1))
        raw[i : i + 1] = draw(st.sampled_from([b"", b"1", b"0", b"-", b",", b":", b'"', b"[", b"]", b"{", b"}",
                                                b"\\u0000", b"F16", b"2.0", b"true", b" "]))
    return bytes(raw)


@FUZZ
@given(st.one_of(canonical_files(), valid_files(), mutated_files()))
def test_fast_checks_agree_with_the_per_entry_checks(raw: bytes) -> None:
    """Same tensors (or the same error message) with the fast path on and off."""
    assert outcome(raw, fast=True) == outcome(raw, fast=False)


def test_fast_path_takes_well_formed_headers(tmp_path: Path) -> None:
    """A real checkpoint's headers go through the fast path, and give what the per-entry checks give."""
    ckpt = moe_checkpoint(tmp_path / "moe", tensors=300, num_files=2)
    for f in sorted(ckpt.glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        assert headers._fast_parse(raw[8 : 8 + n].decode(), len(raw) - 8 - n) is not None
        assert outcome(raw, fast=True) == outcome(raw, fast=False)
        entries, _, columns = outcome(raw, fast=True)  # type: ignore[misc]
        assert len(entries) == len(columns[0]) > 100

"""Fuzz `reshard.format.checkpoint.parse_header`: any bytes are parsed or refused with ReshardError, nothing else.

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

from reshard.errors import ReshardError
from reshard.format import headers
from reshard.format.checkpoint import DTYPE_SIZES, parse_header, read_header
from reshard.testing.moe import moe_checkpoint
from tests.support.core import raw_safetensors

pytestmark = pytest.mark.pure

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

def outcome(raw: bytes, *, tiers: tuple[str, ...] = ("_canonical_parse", "_fast_parse")) -> object:
    """parse_header's entries and metadata plus parse_columns' columns, or the message they refused
    with, with only the fast readers named in `tiers` on (`()`: every check runs one entry at a time,
    as before the fast readers existed)."""
    saved = {tier: getattr(headers, tier) for tier in ("_canonical_parse", "_fast_parse")}
    for tier in saved:
        if tier not in tiers:
            setattr(headers, tier, lambda text, data_len: None)
    try:
        entries, metadata = headers.parse_header(raw, path="f.safetensors", file_size=len(raw))
        _, _, columns = headers.parse_columns(raw, path="f.safetensors", file_size=len(raw))
        return entries, metadata, tuple(map(list, columns))
    except ReshardError as e:
        return str(e)
    finally:
        for tier, fn in saved.items():
            setattr(headers, tier, fn)


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
    """Same tensors (or the same error message) with each fast reader on, and with none."""
    slow = outcome(raw, tiers=())
    assert outcome(raw) == outcome(raw, tiers=("_canonical_parse",)) == outcome(raw, tiers=("_fast_parse",)) == slow


def test_fast_path_takes_well_formed_headers(tmp_path: Path) -> None:
    """A real checkpoint's headers go through both fast readers, which give what the per-entry checks
    give; compact JSON with the keys in another order goes through the second."""
    ckpt = moe_checkpoint(tmp_path / "moe", tensors=300, num_files=2)
    for f in sorted(ckpt.glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        text, data_len = raw[8 : 8 + n].decode(), len(raw) - 8 - n
        assert headers._canonical_parse(text, data_len) is not None and headers._fast_parse(text, data_len) is not None
        entries, _, columns = outcome(raw, tiers=())  # type: ignore[misc]
        assert outcome(raw) == outcome(raw, tiers=("_fast_parse",)) == (entries, {"format": "pt"}, columns)
        assert len(entries) == len(columns[0]) > 100
        shuffled = {k: dict(reversed(v.items())) if k != "__metadata__" else v for k, v in json.loads(text).items()}
        other = json.dumps(shuffled, separators=(",", ":"))
        assert headers._canonical_parse(other, data_len) is None and headers._fast_parse(other, data_len) is not None


E4 = '{"dtype":"F32","shape":[1],"data_offsets":[%d,%d]}'
LOOK_ALIKES = {  # texts close to what safetensors writes, each wrong (or odd) in one way
    "missing comma, trailing comma": '{"a":' + E4 % (0, 4) + '"b":' + E4 % (4, 8) + ",}",
    "trailing comma": '{"a":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + ",}",
    "an entry named __metadata__": '{"__metadata__":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}",
    "metadata, then an entry named __metadata__": '{"__metadata__":{},"__metadata__":' + E4 % (0, 4) + ',"b":'
                                                  + E4 % (4, 8) + "}",
    "a name twice, tiling": '{"a":' + E4 % (0, 4) + ',"a":' + E4 % (4, 8) + "}",
    "a leading zero": '{"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]},"b":' + E4 % (4, 8) + "}",
    "a leading zero in an offset": '{"a":' + E4 % (0, 4) + ',"b":{"dtype":"F32","shape":[1],"data_offsets":[04,8]}}',
    "a metadata key twice": '{"__metadata__":{"k":"x","k":"y"},"a":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}",
    "metadata last": '{"a":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + ',"__metadata__":{"k":"v"}}',
    "metadata not strings": '{"__metadata__":{"k":1},"a":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}",
    "a space inside": '{"a": ' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}",
    "tab padding": '{"a":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}\t",
    "an escaped quote in a name": '{"a\\"":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}",
    "a colon in a name": '{"a:b":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}  ",
    "a negative offset": '{"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]},"b":' + E4 % (4, 8) + "}",
    "unknown dtype": '{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]},"b":' + E4 % (4, 8) + "}",
    "out of order": '{"b":' + E4 % (4, 8) + ',"a":' + E4 % (0, 4) + "}",
    "garbage between": '{"a":' + E4 % (0, 4) + ',x"b":' + E4 % (4, 8) + "}",
    "an empty dimension": '{"a":{"dtype":"U8","shape":[2,,2],"data_offsets":[0,4]},"b":' + E4 % (4, 8) + "}",
    "a comma ending a shape": '{"a":{"dtype":"U8","shape":[4,],"data_offsets":[0,4]},"b":' + E4 % (4, 8) + "}",
    "a control character in a name": '{"a\x01":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}",
    "a tab in a name": '{"a\t":' + E4 % (0, 4) + ',"b":' + E4 % (4, 8) + "}",
    "non-ASCII names": '{"ä":' + E4 % (0, 4) + ',"名":' + E4 % (4, 8) + "}",
}


@pytest.mark.parametrize("case", sorted(LOOK_ALIKES))
def test_fast_readers_on_look_alikes(case: str) -> None:
    """Each agrees with the per-entry checks (same tensors, or the same error)."""
    raw = raw_safetensors(LOOK_ALIKES[case].encode(), bytes(8))
    slow = outcome(raw, tiers=())
    assert outcome(raw, tiers=("_canonical_parse",)) == outcome(raw, tiers=("_fast_parse",)) == slow, slow

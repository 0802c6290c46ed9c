"""The rank-file format, in one place: its file name, its version, and its `__metadata__`.

A rank file is an ordinary safetensors file named `rank-RRRRR-of-WWWWW.safetensors` (rank, then world
size, 5 digits each) whose `__metadata__` describes it (every value a string, as safetensors wants):

    format   "reshard.rank/1" (`FORMAT`)
    tp       the tensor-parallel size, e.g. "4"
    rank     this file's global rank, e.g. "1"
    layout   (beyond TP only) the parallel sizes other than 1, JSON: {"tp":2,"pp":2}
    coords   (beyond TP only) this rank's coordinates, JSON: {"pp":1,"dp_replicate":0,...}
    tensors  per tensor, JSON with sorted keys: {"kind", "shape" (global), "select" (per dim, the
             [begin, end) intervals of the global tensor it holds), "options" (when the rule has any)}

A training checkpoint keeps an optimizer's per-parameter tensors (AdamW's moments) in a second set of
rank files of this format, in `OPTIMIZER_DIR` beside the parameters' files, each named by
`optimizer_tensor_name(parameter, slot)` and described exactly like its parameter (same kind, shape and
selection), so every tool that reads rank files cuts a moment by its parameter's rule.

`encode_metadata` writes it, `decode_metadata` reads and validates it (the layout as plain values:
`reshard.layout.placement.describe_layout` makes its `Layout`). `HeaderEncoder` is the planner's fast
path to the same header bytes for many tensors; a new field is added here once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str  # type: ignore[attr-defined]
from typing import Any

from reshard.errors import CheckpointError

__all__ = ["FORMAT", "HeaderEncoder", "RankMeta", "RankPlace", "decode_metadata", "describe_tensor", "encode_metadata",
           "OPTIMIZER_DIR", "OPTIMIZER_SLOTS", "header_prefix", "is_rank_file_name", "optimizer_tensor_name",
           "parse_optimizer_tensor_name", "parse_rank_file_name", "rank_file_name", "tensor_json"]

FORMAT = "reshard.rank/1"
_NAME = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")
_COMPACT = (",", ":")


# --- the file name -------------------------------------------------------------------------------

def rank_file_name(rank: int, world: int) -> str:
    """`rank-00001-of-00004.safetensors`: the file of rank `rank` of a world of `world` ranks."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def parse_rank_file_name(name: str) -> tuple[int, int] | None:
    """(rank, world) of a rank file's name; None for any other name."""
    m = _NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_rank_file_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


# --- optimizer tensors ---------------------------------------------------------------------------

OPTIMIZER_DIR = "optimizer"
OPTIMIZER_SLOTS = ("exp_avg", "exp_avg_sq")
TRAINER_STATE_NAME = "trainer_state.json"  # a training checkpoint's JSON half (`reshard.trainer.state_json`)


def optimizer_tensor_name(param: str, slot: str) -> str:
    """The name of `param`'s optimizer tensor `slot` (one of `OPTIMIZER_SLOTS`): `PARAM.SLOT`."""
    if slot not in OPTIMIZER_SLOTS:
        raise ValueError(f"optimizer slot {slot!r}: not one of {OPTIMIZER_SLOTS}")
    return f"{param}.{slot}"


def parse_optimizer_tensor_name(name: str) -> tuple[str, str] | None:
    """(parameter, slot) of an optimizer tensor's name; None for any other name."""
    param, _, slot = name.rpartition(".")
    return (param, slot) if param and slot in OPTIMIZER_SLOTS else None


# --- __metadata__ --------------------------------------------------------------------------------

def describe_tensor(kind: str, shape: Sequence[int], selection: Sequence[Sequence[tuple[int, int]]],
                    options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One tensor's self-description in `tensors`: its kind, global shape, selection and rule options."""
    out: dict[str, Any] = {"kind": kind, "shape": list(shape), "select": [[list(iv) for iv in dim] for dim in selection]}
    if options:
        out["options"] = options
    return out


def tensor_json(description: Mapping[str, Any]) -> str:
    """One description as the `tensors` value holds it: compact JSON with sorted keys."""
    return json.dumps(description, separators=_COMPACT, sort_keys=True)


@dataclass(frozen=True)
class RankPlace:
    """Where a rank file sits: `tp`, its `rank`, and beyond TP the `layout` (parallel sizes other than 1,
    tp always) and the rank's `coords`, as plain values (`reshard.layout` makes them)."""

    tp: int
    rank: int
    layout: dict[str, Any] | None = None
    coords: dict[str, Any] | None = None


@dataclass(frozen=True)
class RankMeta(RankPlace):
    """A decoded, validated `__metadata__`: the file's place and every tensor's description."""

    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)


def encode_metadata(place: RankPlace, tensors: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """A rank file's `__metadata__` (the module docstring)."""
    meta = _head(place)
    meta["tensors"] = json.dumps(tensors, separators=_COMPACT, sort_keys=True)
    return meta


def _head(place: RankPlace) -> dict[str, str]:
    meta = {"format": FORMAT, "tp": str(place.tp), "rank": str(place.rank)}
    if place.layout is not None:
        meta["layout"] = json.dumps(place.layout, separators=_COMPACT)
    if place.coords is not None:
        meta["coords"] = json.dumps(place.coords, separators=_COMPACT)
    return meta


def decode_metadata(meta: Mapping[str, str], where: str) -> RankMeta:
    """`meta` read back and checked (`CheckpointError` naming `where` unless it is a rank file's)."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a reshard rank file (metadata format {meta.get('format')!r}, "
                              f"expected {FORMAT!r})")
    tp, rank = _int(meta, "tp", where), _int(meta, "rank", where)
    layout, coords = _object(meta, "layout", where), _object(meta, "coords", where)
    try:
        tensors = json.loads(meta["tensors"])
        assert isinstance(tensors, dict) and all({"kind", "shape", "select"} <= set(v) for v in tensors.values())
    except (KeyError, ValueError, AssertionError, TypeError):
        raise CheckpointError(f"{where}: metadata `tensors` is missing or malformed") from None
    return RankMeta(tp, rank, layout, coords, tensors)


def _int(meta: Mapping[str, str], key: str, where: str) -> int:
    try:
        return int(meta[key])
    except (KeyError, ValueError, TypeError):
        raise CheckpointError(f"{where}: metadata has no {key}") from None


def _object(meta: Mapping[str, str], key: str, where: str) -> dict[str, Any] | None:
    if key not in meta:
        return None
    try:
        obj = json.loads(meta[key])
    except (ValueError, TypeError):
        obj = None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: metadata `{key}`: not a JSON object: {meta[key][:100]!r}")
    return obj


# --- the planner's fast path ---------------------------------------------------------------------

def header_prefix(place: RankPlace) -> str:
    """The header JSON up to the `tensors` value's opening quote: `{"__metadata__":{"format":...,"tensors":"`."""
    meta = _head(place)
    meta["tensors"] = ""
    return json.dumps({"__metadata__": meta}, separators=_COMPACT)[:-3]


class HeaderEncoder:
    """The headers of rank files of one set of tensors, from per-tensor JSON fragments (planning
    100,000 tensors for every rank; `reshard.plan.planner`). For tensors named `names` (sorted) and put
    in the file in `ordered` order, `header(prefix, described, entries(heads, begins, ends))` equals

        encode_header(encode_metadata(place, descriptions),
                      [(n, dtype, shape, begin, end) for n in ordered])

    (`reshard.format.headers.encode_header`: `json.dumps` with `separators=(",", ":")`, padded with
    spaces to 8 bytes, after its 8-byte length) where `prefix = header_prefix(place)`,
    `described[i] = escape(tensor_json(descriptions[names[i]]))` and `heads[i]` is `entry_head(dtype,
    shape)` of `ordered[i]`. A test compares the two."""

    def __init__(self, names: list[str], ordered: list[str]) -> None:
        # '"name":' in file order, and in name order escaped as the content of a JSON string (the
        # metadata's "tensors" value), each with a comma before it but the first
        if len(_json_str("".join(names))) == 2 + sum(map(len, names)):  # no name needs escaping
            self._quoted = _first_bare([f',"{n}":' for n in ordered])
            self._sorted_quoted = _first_bare([f',\\"{n}\\":' for n in names])
        else:
            quoted = {n: _json_str(n) + ":" for n in names}
            self._quoted = _first_bare(["," + quoted[n] for n in ordered])
            self._sorted_quoted = _first_bare(["," + _json_str(q)[1:-1] for q in quoted.values()])

    @staticmethod
    def escape(text: str) -> str:
        """`text` as the content of a JSON string (`json.dumps(text)[1:-1]`): JSON escapes character by
        character, so the escaped `tensors` value is the escaped fragments joined."""
        return _json_str(text)[1:-1]

    @staticmethod
    def entry_head(dtype: str, shape: Sequence[int]) -> str:
        """A header entry up to its first offset: `{"dtype":"BF16","shape":[2,3],"data_offsets":[`."""
        return json.dumps({"dtype": dtype, "shape": list(shape)}, separators=_COMPACT)[:-1] + ',"data_offsets":['

    def entries(self, heads: list[str], begins: list[str], ends: list[str]) -> str:
        """The header's tensor entries in file order without the braces around them: `",".join` of
        `json.dumps(name) + ":" + heads[i] + begins[i] + "," + ends[i] + "]}"`."""
        n = len(ends)
        return "".join(_rows(self._quoted, heads, begins, [","] * n, ends, ["]}"] * n))

    def header(self, prefix: str, described: list[str], entries: str) -> bytes:
        """The header bytes (see the class docstring)."""
        parts = _rows(self._sorted_quoted, described)
        parts[:0] = [prefix, "{"]
        parts += ['}"}', "," if entries else "", entries, "}"]
        size = sum(map(len, parts))
        parts.append(" " * (-size % 8))
        # all ASCII (json escapes the rest), so latin-1 gives the same bytes as utf-8; with the length
        # prefix as its 8 characters, the header is one join and one encode
        parts.insert(0, (size + -size % 8).to_bytes(8, "little").decode("latin-1"))
        return "".join(parts).encode("latin-1")


def _first_bare(items: list[str]) -> list[str]:
    """Comma-led `items` with the first comma dropped: joined, they are `",".join` of the bare ones."""
    if items:
        items[0] = items[0][1:]
    return items


def _rows(*columns: list[str]) -> list[str]:
    """The columns' strings row by row: joined, `"".join(a + b + ... for a, b, ... in zip(*columns))`
    without a string per row."""
    width = len(columns)
    parts = [""] * (width * len(columns[0]))
    for j, column in enumerate(columns):
        parts[j::width] = column
    return parts

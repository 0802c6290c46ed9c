"""The rank-file format, in one place: its file name, its version, and its `__metadata__`.

A rank file is an ordinary safetensors file named `rank-RRRRR-of-WWWWW.safetensors` (rank, then world
size, 5 digits each) whose `__metadata__` describes it (every value a string, as safetensors wants):

    format   "reshard.rank/1" (`FORMAT`)
    tp       the tensor-parallel size, e.g. "4"
    rank     this file's global rank, e.g. "1"
    layout   (beyond TP only) the parallel sizes other than 1, JSON: {"tp":2,"pp":2}
    coords   (beyond TP only) this rank's coordinates, JSON: {"pp":1,"dp_replicate":0,...}
    plan     the plan's identity, the same in every rank file of one write or save (`plan_identity`: a
             digest of the layout and of every tensor's name, global shape, kind and options, whatever
             the source), so a set whose files record different plans is refused as it is opened
             (`reshard.io.source.rank_dir`: merge, write, serve)
    tensors  per tensor, JSON with sorted keys: {"kind", "shape" (global), "select" (per dim, the
             [begin, end) intervals of the global tensor it holds), "options" (when the rule has any)}
    DCP_SHARDING_INFO, DCP_VERSION
             what torch's `HuggingFaceStorageReader` reads (`reshard.format.dcp_sharding`): the offsets in
             its global tensor of every tensor that is one box of it (`dcp_offsets`), so `dcp.load(sd,
             storage_reader=HuggingFaceStorageReader(DIR))` loads a directory of rank files into any
             DTensor placements. A tensor that is not one box (a packed kind's blocks, padding past the
             global size) has no entry, and torch's reader refuses the directory (docs/dcp.md).

A training checkpoint keeps an optimizer's per-parameter tensors (AdamW's moments) in a second set of
rank files of this format, in `OPTIMIZER_DIR` beside the parameters' files, each named by
`optimizer_tensor_name(parameter, slot)` and described exactly like its parameter (same kind, shape and
selection), so every tool that reads rank files cuts a moment by its parameter's rule.

`encode_metadata` writes it, `decode_metadata` reads and validates it (the layout as plain values:
`reshard.layout.placement.describe_layout` makes its `Layout`). `HeaderEncoder` is the planner's fast
path to the same header bytes for many tensors; a new field is added here once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str  # type: ignore[attr-defined]
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.dcp_sharding import (
    DCP_VERSION,
    DCP_VERSION_KEY,
    SHARDING_KEY,
    offsets_fragment,
    sharding_metadata,
)

__all__ = ["FORMAT", "HEADER_REVISION", "HeaderEncoder", "RankMeta", "RankPlace", "dcp_fragment", "dcp_offsets", "decode_metadata",
           "describe_tensor", "encode_metadata",
           "OPTIMIZER_DIR", "OPTIMIZER_SLOTS", "header_prefix", "is_rank_file_name", "optimizer_tensor_name",
           "parse_optimizer_tensor_name", "parse_rank_file_name", "plan_identity", "rank_file_name", "rule_json",
           "tensor_json"]

FORMAT = "reshard.rank/1"
# what a plan's identity records besides FORMAT: changes whenever the same plan makes other header bytes (so
# ETags, recorded sha256 digests and caches of the old bytes no longer match); 2: DCP_SHARDING_INFO added;
# 3: the plan's identity (`plan`) added
HEADER_REVISION = 3
_PLAN_ID = re.compile(r"[0-9a-f]{32}")
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
    tp always) and the rank's `coords`, as plain values (`reshard.layout` makes them); `plan`: the
    identity of the plan it belongs to (`plan_identity`; None in files of header revisions before 3)."""

    tp: int
    rank: int
    layout: dict[str, Any] | None = None
    coords: dict[str, Any] | None = None
    plan: str | None = None


@dataclass(frozen=True)
class RankMeta(RankPlace):
    """A decoded, validated `__metadata__`: the file's place and every tensor's description."""

    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)


def encode_metadata(place: RankPlace, tensors: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """A rank file's `__metadata__` (the module docstring)."""
    meta = _head(place)
    meta["tensors"] = json.dumps(tensors, separators=_COMPACT, sort_keys=True)
    boxes = {n: o for n, d in tensors.items() if (o := dcp_offsets(d)) is not None}
    meta.update(sharding_metadata(boxes))
    return meta


def rule_json(kind: str, options: Mapping[str, Any] | None) -> str:
    """A rule as `plan_identity` takes it: its kind and options, compact JSON with sorted keys."""
    return json.dumps([kind, dict(options or {})], separators=_COMPACT, sort_keys=True)


def plan_identity(layout: Mapping[str, int], tensors: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """A plan's identity: 32 hex digits of the sha256 of the layout (its sizes other than 1, tp always)
    and of every tensor's (name, global shape, `rule_json` of its kind and options), in name order. What
    a rank holds follows from these alone, so every rank file of one plan records the same value whatever
    source it was read from (an HF checkpoint, DCP, rank files of another layout) and in whatever dtype.
    Not `Plan.identity` (`reshard.plan.planner.make_planner`), which also names the source's files: an
    ETag's input, where this is the files' agreement."""
    h = hashlib.sha256(json.dumps({"format": FORMAT, "layout": dict(layout)}, separators=_COMPACT, sort_keys=True).encode())
    h.update("".join(f"\n{_json_str(name)}{list(shape)}{rule}" for name, shape, rule in sorted(tensors)).encode())
    return h.hexdigest()[:32]


def dcp_offsets(description: Mapping[str, Any]) -> list[int] | None:
    """Where a tensor (its description) sits in its global tensor, when it is one box of it (one
    interval per dim, inside the global shape): the interval starts; None otherwise."""
    select, shape = description["select"], description["shape"]
    if len(select) != len(shape) or any(len(dim) != 1 or dim[0][1] > n for dim, n in zip(select, shape)):
        return None
    return [dim[0][0] for dim in select]


def dcp_fragment(description: Mapping[str, Any]) -> str:
    """The tensor's value in `DCP_SHARDING_INFO` as compact JSON, "" when it has none (the planner's path)."""
    offsets = dcp_offsets(description)
    return "" if offsets is None else offsets_fragment(offsets)


def _head(place: RankPlace) -> dict[str, str]:
    meta = {"format": FORMAT, "tp": str(place.tp), "rank": str(place.rank)}
    if place.layout is not None:
        meta["layout"] = json.dumps(place.layout, separators=_COMPACT)
    if place.coords is not None:
        meta["coords"] = json.dumps(place.coords, separators=_COMPACT)
    if place.plan is not None:
        meta["plan"] = place.plan
    return meta


def decode_metadata(meta: Mapping[str, str], where: str) -> RankMeta:
    """`meta` read back and checked (`CheckpointError` naming `where` unless it is a rank file's)."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a reshard rank file (metadata format {meta.get('format')!r}, "
                              f"expected {FORMAT!r})")
    tp, rank = _int(meta, "tp", where), _int(meta, "rank", where)
    layout, coords = _object(meta, "layout", where), _object(meta, "coords", where)
    plan = meta.get("plan")
    if plan is not None and not (isinstance(plan, str) and _PLAN_ID.fullmatch(plan)):
        raise CheckpointError(f"{where}: metadata `plan`: not a plan identity (32 hex digits): {str(plan)[:100]!r}")
    try:
        tensors = json.loads(meta["tensors"])
        assert isinstance(tensors, dict) and all({"kind", "shape", "select"} <= set(v) for v in tensors.values())
    except (KeyError, ValueError, AssertionError, TypeError):
        raise CheckpointError(f"{where}: metadata `tensors` is missing or malformed") from None
    return RankMeta(tp, rank, layout, coords, plan, tensors)


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
    in the file in `ordered` order, `header(prefix, described, entries(heads, begins, ends), placed)` equals

        encode_header(encode_metadata(place, descriptions),
                      [(n, dtype, shape, begin, end) for n in ordered])

    (`reshard.format.headers.encode_header`: `json.dumps` with `separators=(",", ":")`, padded with
    spaces to 8 bytes, after its 8-byte length) where `prefix = header_prefix(place)`,
    `described[i] = escape(tensor_json(descriptions[names[i]]))`, `placed[i] =
    escape(dcp_fragment(descriptions[names[i]]))` and `heads[i]` is `entry_head(dtype, shape)` of
    `ordered[i]`. A test compares the two."""

    def __init__(self, names: list[str], ordered: list[str]) -> None:
        # '"name":' in file order, and in name order escaped as the content of a JSON string (the
        # metadata's "tensors" value), each with a comma before it but the first
        if len(_json_str("".join(names))) == 2 + sum(map(len, names)):  # no name needs escaping
            self._quoted = _first_bare([f',"{n}":' for n in ordered])
            self._keys = [f'\\"{n}\\":' for n in names]
        else:
            quoted = {n: _json_str(n) + ":" for n in names}
            self._quoted = _first_bare(["," + quoted[n] for n in ordered])
            self._keys = [_json_str(q)[1:-1] for q in quoted.values()]
        self._sorted_quoted = _first_bare(["," + k for k in self._keys])

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

    def header(self, prefix: str, described: list[str], entries: str, placed: list[str]) -> bytes:
        """The header bytes (see the class docstring); `placed[i]` is `escape(dcp_fragment(descriptions[names[i]]))`."""
        parts = _rows(self._sorted_quoted, described)
        parts[:0] = [prefix, "{"]
        boxes = _first_bare([f",{key}{frag}" for key, frag in zip(self._keys, placed) if frag])
        parts += [f'}}","{SHARDING_KEY}":"{{', *boxes, f'}}","{DCP_VERSION_KEY}":"{DCP_VERSION}"}}',
                  "," if entries else "", entries, "}"]
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

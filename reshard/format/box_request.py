"""The boxes formats, in one place: a request for blocks of named tensors, and the answer's `__metadata__`.

A **box** names a tensor of a source and a block of it: `offsets` (where the block starts, per dim) and
`sizes` (how long it is, per dim), as torch DCP's read items and `torch.narrow` say it:

    Box("model.layers.0.mlp.up_proj.weight", offsets=(128, 0), sizes=(128, 4096))   # rows 128..255
    # as JSON: {"name": "model.layers.0.mlp.up_proj.weight", "offsets": [128, 0], "sizes": [128, 4096]}

A request is a list of boxes (`{"boxes": [...]}` over HTTP). The answer is one safetensors file: an
entry per box, named by `box_keys` (the tensor's name when the request has one box of it, else the name
followed by the block as slices, `NAME[128:256,0:4096]`), of the tensor's dtype and the box's sizes, in
safetensors' order (largest item size first, then key). Its `__metadata__`:

    format   "reshard.boxes/1" (`BOXES_FORMAT`)
    boxes    per key, JSON with sorted keys: {"name", "offsets", "sizes", "shape" (the tensor's global shape)}

`check_boxes` validates a request against the tensors' shapes (every problem found named, up to a few);
`boxes_digest` identifies a request (the answer's ETag is made of it and the source's identity).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import BoxError, HeaderError
from reshard.format.selection import Selection

__all__ = ["BOXES_FORMAT", "Box", "box_keys", "boxes_digest", "check_boxes", "decode_box_metadata",
           "encode_box_metadata"]

BOXES_FORMAT = "reshard.boxes/1"
_LIST = 6  # problems named in one error
_COMPACT = (",", ":")


@dataclass(frozen=True)
class Box:
    """A block of tensor `name`: `sizes[d]` indices from `offsets[d]` along each dim d."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:  # lists (from JSON) become tuples: a box is hashable
        object.__setattr__(self, "offsets", tuple(self.offsets))
        object.__setattr__(self, "sizes", tuple(self.sizes))

    @classmethod
    def whole(cls, name: str, shape: Sequence[int]) -> Box:
        """All of tensor `name` of `shape`."""
        return cls(name, (0,) * len(shape), tuple(shape))

    @property
    def selection(self) -> Selection:
        """The box as a selection (`reshard.format.selection`): one interval per dim."""
        return tuple(((o, o + s),) for o, s in zip(self.offsets, self.sizes))

    @property
    def slices(self) -> str:
        """`[a:b,c:d]`: the block in slice notation (a 0-d tensor: `[]`)."""
        return "[" + ",".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "offsets": list(self.offsets), "sizes": list(self.sizes)}


def box_keys(boxes: Sequence[Box]) -> list[str]:
    """The answer's entry name of each box: its tensor's name where the request has one box of that
    tensor, else the name followed by the block (`NAME[0:128,0:64]`)."""
    counts = Counter(b.name for b in boxes)
    return [b.name if counts[b.name] == 1 else b.name + b.slices for b in boxes]


def boxes_digest(boxes: Sequence[Box]) -> str:
    """sha256 of the request as canonical JSON (order kept: it orders nothing in the answer, but a
    client pairs boxes and keys by position)."""
    blob = json.dumps([[b.name, list(b.offsets), list(b.sizes)] for b in boxes], separators=_COMPACT)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_boxes(boxes: Sequence[Box], shape_of: Callable[[str], Sequence[int] | None], *, where: str) -> None:
    """`BoxError` naming every problem (up to a few) unless each box names a tensor (`shape_of(name)` is
    its shape, None: no such tensor), has one offset and one size per dim, none negative, and ends within
    the tensor, and no box is asked for twice. `where` names the source in the message."""
    problems: list[str] = []
    unknown: list[str] = []
    for i, box in enumerate(boxes):
        shape = shape_of(box.name)
        if shape is None:
            unknown.append(box.name)
            continue
        problems += _box_problems(i, box, tuple(shape))
    if unknown:
        names = sorted(set(unknown))
        more = f" and {len(names) - _LIST} more" if len(names) > _LIST else ""
        problems.insert(0, f"no tensor named {', '.join(map(repr, names[:_LIST]))}{more} (GET the checkpoint "
                           "to list its tensors)")
    twice = [b for b, n in Counter(boxes).items() if n > 1]
    if twice:
        problems.append(f"{len(twice)} boxes asked for more than once, e.g. {twice[0].name}{twice[0].slices}: "
                        "ask for each once")
    if problems:
        more = f" (and {len(problems) - _LIST} more)" if len(problems) > _LIST else ""
        raise BoxError(f"{where}: {len(boxes)} boxes asked for, not answered: " + "; ".join(problems[:_LIST]) + more)


def _box_problems(i: int, box: Box, shape: tuple[int, ...]) -> list[str]:
    what = f"box {i} ({box.name}, shape {list(shape)})"
    if len(box.offsets) != len(shape) or len(box.sizes) != len(shape):
        return [f"{what}: {len(box.offsets)} offsets and {len(box.sizes)} sizes for a {len(shape)}-d tensor; "
                f"give {len(shape)} of each"]
    if any(type(x) is not int for x in (*box.offsets, *box.sizes)):
        return [f"{what}: offsets and sizes must be integers"]
    if any(x < 0 for x in (*box.offsets, *box.sizes)):
        return [f"{what}: offsets {list(box.offsets)} and sizes {list(box.sizes)} must not be negative"]
    past = [d for d, (o, s, n) in enumerate(zip(box.offsets, box.sizes, shape)) if o + s > n]
    if past:
        d = past[0]
        return [f"{what}: dim {d} ends at {box.offsets[d] + box.sizes[d]} (offset {box.offsets[d]} + size "
                f"{box.sizes[d]}), past its size {shape[d]}"]
    return []


def encode_box_metadata(boxes: Sequence[Box], keys: Sequence[str], shapes: Sequence[Sequence[int]]) -> dict[str, str]:
    """The answer's `__metadata__` (the module docstring); `shapes` are the tensors' global shapes."""
    described = {k: {**b.to_json(), "shape": list(s)} for b, k, s in zip(boxes, keys, shapes)}
    return {"format": BOXES_FORMAT, "boxes": json.dumps(described, separators=_COMPACT, sort_keys=True)}


def decode_box_metadata(meta: Mapping[str, str] | None, *, source: str) -> dict[str, tuple[Box, tuple[int, ...]]]:
    """Per key, (the box, its tensor's global shape) from an answer's `__metadata__`; `HeaderError` when it
    is not an answer to a boxes request."""
    if not meta or meta.get("format") != BOXES_FORMAT:
        raise HeaderError(f"{source}: not an answer to a boxes request (its __metadata__ format is "
                          f"{(meta or {}).get('format')!r}, expected {BOXES_FORMAT!r})")
    try:
        described = json.loads(meta["boxes"])
        return {k: (Box(d["name"], d["offsets"], d["sizes"]), tuple(d["shape"])) for k, d in described.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise HeaderError(f"{source}: the answer's box descriptions are malformed: {e}") from None

"""Boxes of a source's tensors into tensors: `read_boxes`, the library form of "these blocks of these tensors".

    boxes = [Box("model.embed_tokens.weight", (0, 0), (64, 4096)), Box("lm_head.weight", (64, 0), (64, 4096))]
    a, b = read_boxes("http://HOST:PORT/v1/checkpoints/NAME", boxes)      # one request; or a path, s3://...
    read_boxes("ckpt/", boxes, out=[param_a, param_b.narrow(0, 0, 64)])   # straight into tensors you hold

The answer (`reshard.io.client.box_client.open_boxes`: the service's, or planned here from any source)
is read in file order; each box's bytes go straight into its `out` tensor where that is a contiguous CPU
tensor of the checkpoint's dtype, else through one box-sized buffer and `copy_` (a cast, a strided view,
another device). A box asked for twice is read once and copied to both. The service's answer is hashed
as it lands and checked against its sha256; the answer's own description of each entry (which box it
is) is checked against the request before any byte is read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import torch

from reshard.errors import IntegrityError, ReshardError
from reshard.fill.into_params import PIECE, byte_view, read_raw_header
from reshard.format.box_request import Box, box_keys, decode_box_metadata
from reshard.format.checkpoint import Source, parse_header
from reshard.format.torch_side import TORCH_DTYPES
from reshard.io.client.body import RankBytes
from reshard.io.client.box_client import open_boxes
from reshard.io.hashing import BackgroundHash

__all__ = ["read_boxes", "read_boxes_into"]


def read_boxes(source: str | os.PathLike[str] | Source, boxes: Sequence[Box], *,
               out: Sequence[torch.Tensor | None] | None = None, token: str | None = None,
               timeout: float = 60.0) -> list[torch.Tensor]:
    """Each of `boxes` of `source`'s tensors (the module docstring): `out[i]` filled and returned where given
    (its shape must be the box's sizes; its dtype and device are its own), else a new CPU tensor of the
    checkpoint's dtype. `source`: the service's checkpoint URL, anything `reshard` reads, or a source
    opened already (`reshard.io.source.opener.open_tensors`)."""
    return _answer(source, boxes, out, token=token, timeout=timeout)[0]


def read_boxes_into(source: str | os.PathLike[str] | Source, boxes: Sequence[Box], out: Sequence[torch.Tensor], *,
                    token: str | None = None, timeout: float = 60.0) -> int:
    """`read_boxes` into `out` (one tensor per box); the bytes of the answer (its header included)."""
    return _answer(source, boxes, out, token=token, timeout=timeout)[1]


def _answer(source: str | os.PathLike[str] | Source, boxes: Sequence[Box], out: Sequence[torch.Tensor | None] | None,
            *, token: str | None, timeout: float) -> tuple[list[torch.Tensor], int]:
    if out is not None and len(out) != len(boxes):
        raise ValueError(f"out has {len(out)} tensors for {len(boxes)} boxes")
    for i, t in enumerate(out or ()):
        if t is not None and tuple(t.shape) != tuple(boxes[i].sizes):
            raise ReshardError(f"out[{i}] has shape {list(t.shape)}, box {i} ({boxes[i].name}) has sizes "
                               f"{list(boxes[i].sizes)}")
    unique = list(dict.fromkeys(boxes))
    if not unique:
        return [], 0
    targets: dict[Box, list[torch.Tensor]] = {b: [] for b in unique}
    for t, b in zip(out or (), boxes):
        if t is not None:
            targets[b].append(t)
    body = open_boxes(source, unique, token=token, timeout=timeout)
    try:
        got = _read(body, unique, targets)
    finally:
        body.close()
    return [out[i] if out is not None and out[i] is not None else got[b] for i, b in enumerate(boxes)], body.size


def _read(body: RankBytes, unique: list[Box], targets: dict[Box, list[torch.Tensor]]) -> dict[Box, torch.Tensor]:
    """Every box of the answer `body` into its targets (or a new tensor), in file order; verified."""
    raw = read_raw_header(body, body.name)
    entries, meta = parse_header(raw, path=body.name, file_size=body.size)
    keys = box_keys(unique)
    described = decode_box_metadata(meta, source=body.name)
    for key, box in zip(keys, unique):
        if key not in entries or described.get(key, (None,))[0] != box or tuple(entries[key]["shape"]) != box.sizes:
            raise IntegrityError(f"{body.name}: the answer does not hold box {key} as asked; "
                                 "nothing was read from it")
    order = sorted(zip(keys, unique), key=lambda kb: entries[kb[0]]["data_offsets"][0])
    result: dict[Box, torch.Tensor] = {}
    check = body.verify
    with BackgroundHash(hashlib.sha256() if check else None, backlog=None) as hasher:
        hasher.update(raw)
        for key, box in order:
            dtype = TORCH_DTYPES[entries[key]["dtype"]]
            first = targets[box][0] if targets[box] else None
            direct = first is not None and first.device.type == "cpu" and first.dtype == dtype and first.is_contiguous()
            dst = first if direct else torch.empty(box.sizes, dtype=dtype)
            view = byte_view(dst) if dst.numel() else memoryview(bytearray())
            for at in range(0, len(view), PIECE):
                piece = view[at : at + PIECE]
                body.readinto(piece)
                hasher.update(piece)
            if not direct and first is not None:
                hasher.wait()  # a staging buffer: hashed before it is released
            with torch.no_grad():
                for t in targets[box][1 if direct else 0 :]:
                    t.copy_(dst)
            result[box] = dst if first is None else first
        got = hasher.hexdigest() if check else None
    want = body.expected_sha256() if check else None
    if got is not None and want is not None and got != want:
        raise IntegrityError(f"{body.name}: sha256 {got} of the answer does not match the server's {want}; "
                             "the tensors read are not to be trusted: read them again")
    return result

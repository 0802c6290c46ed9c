"""The references the boxes tests compare with: a checkpoint's full tensors read with safetensors, torch
slicing of a box, and random boxes of a set of tensors.

    full = full_tensors(ckpt_dir)                  # name -> tensor, from every *.safetensors file
    assert torch.equal(answer[key], sliced(full[box.name], box))
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file

from reshard.format.box_request import Box

__all__ = ["full_tensors", "random_boxes", "sliced"]


def full_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def sliced(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]


def random_boxes(full: dict[str, torch.Tensor], n: int, seed: int, *, empty: bool = True) -> list[Box]:
    """`n` random boxes (fewer where one repeats), of random tensors of `full`; some of size 0 in a dim
    unless not `empty`."""
    rng = random.Random(seed)
    names = sorted(full)
    boxes = []
    for _ in range(n):
        name = rng.choice(names)
        shape = full[name].shape
        offsets = [rng.randrange(0, d) for d in shape]
        sizes = [rng.randrange(0 if empty else 1, d - o + 1) for o, d in zip(offsets, shape)]
        boxes.append(Box(name, tuple(offsets), tuple(sizes)))
    return list(dict.fromkeys(boxes))

"""What a model's tensor holds, as blocks of its global tensor, and the views its boxes land in.

A DTensor's local tensor holds, along each dim, the global indices DTensor chunks it (`Shard(d)`, uneven
last ranks, `_StridedShard`: `held_indices` finds them, distributing small index tensors); a plain tensor holds all of
itself. `held_blocks` splits those indices into runs and gives each block of the global tensor the
local tensor holds (global offsets, sizes) with where it sits locally: one block for a `Shard`, several
for a strided shard (transformers' packed gate|up: rows of gate, then the same rows of up). With
`reshard.fill.stored_names.boxes_of` each block becomes boxes of tensors on disk, and `landing` is the
view of the local tensor one box's values go to (what is written to it is written to the tensor).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from reshard.errors import PlanError
from reshard.fill.experts import Held

Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # global offsets, sizes, local offsets

__all__ = ["Block", "held_blocks", "held_indices", "landing", "local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (`to_local()` of a DTensor parameter is a view of it, which a fill
    that rebinds storage cannot use), or the tensor."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def held_indices(t: torch.Tensor) -> Held:
    """The global indices a DTensor's local tensor holds along each dim, as DTensor itself chunks them
    (found by distributing small index tensors; no communication). None per dim for a plain tensor.
    Kept per (shape, placements, mesh, this rank's place on it): the layers of a model repeat a few of them."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return (None,) * t.ndim
    mesh = t.device_mesh
    return _held(tuple(t.shape), tuple(t.placements), mesh, tuple(mesh.get_coordinate() or ()))


@functools.lru_cache(maxsize=256)
def _held(shape: tuple[int, ...], placements: tuple[Any, ...], mesh: Any, _coordinate: tuple[int, ...]) -> Held:
    from torch.distributed.tensor import distribute_tensor

    if any(not hasattr(p, "dim") and not p.is_replicate() for p in placements):
        raise PlanError(f"a parameter of shape {list(shape)} has placements {placements}; fill_model fills "
                        "Shard, _StridedShard and Replicate parameters only")
    sharded = {p.dim % len(shape) for p in placements if hasattr(p, "dim")}
    spread = mesh.size() * max([getattr(p, "split_factor", 1) for p in placements] + [1])
    held: list[tuple[int, ...] | None] = []
    for d, size in enumerate(shape):
        if d not in sharded:
            held.append(tuple(range(size)))
            continue
        small = [size if j == d else (min(n, spread) if j in sharded else 1) for j, n in enumerate(shape)]
        idx = torch.arange(size).reshape([size if j == d else 1 for j in range(len(shape))]).expand(small)
        loc = distribute_tensor(idx.contiguous(), mesh, placements, src_data_rank=None).to_local()
        if loc.numel() == 0:
            held.append(())
            continue
        held.append(tuple(loc[tuple(slice(None) if j == d else 0 for j in range(len(shape)))].tolist()))
    return tuple(held)


def held_blocks(t: torch.Tensor, offsets: Sequence[int] | None = None, sizes: Sequence[int] | None = None
                ) -> list[Block]:
    """The global blocks local block (offsets, sizes) of `t` holds (default: all of its local tensor), each
    with its offsets within that local block; a plain tensor's block is itself."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    offsets = tuple(offsets) if offsets is not None else (0,) * local.ndim
    sizes = tuple(sizes) if sizes is not None else tuple(local.shape)
    if not isinstance(t, DTensor):
        return [(offsets, sizes, (0,) * len(sizes))]
    held = held_indices(t)
    per_dim = [_runs(h[a : a + n]) if h is not None else [(0, a, n)] for h, a, n in zip(held, offsets, sizes)]
    return [(tuple(g for _, g, _ in c), tuple(n for _, _, n in c), tuple(at for at, _, _ in c))
            for c in itertools.product(*per_dim)]


@functools.lru_cache(maxsize=1024)
def _runs(indices: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(position, first index, length) of each run of consecutive indices (kept: layers repeat them)."""
    out: list[tuple[int, int, int]] = []
    for pos, g in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, g, 1))
    return tuple(out)


def landing(t: torch.Tensor, at: Sequence[int], sizes: Sequence[int], ndim: int) -> torch.Tensor:
    """The view of `t` a box of `ndim` dims lands in: block (at, sizes) of it, its leading expert dim dropped
    where the box is one expert's of a fused tensor."""
    for d, (a, n) in enumerate(zip(at, sizes)):
        if a or n != t.shape[d]:
            t = t.narrow(d, a, n)
    return t.select(0, 0) if t.ndim == ndim + 1 else t

"""Fill a model by what it holds: each tensor's blocks, from its DTensor placements, read as boxes.

`fill_model(model, source, follow="model")` asks no plan of reshard's what a rank holds: the model says
it. Every parameter and persistent buffer is named as the model names it (transformers' renames, fused
MoE experts, a tied head: `reshard.fill.stored_names`, from the model's own conversion mapping), and what
its local tensor holds is read from the DTensor (`reshard.fill.held_boxes`: `Shard`, uneven chunks,
`_StridedShard`), so whatever plan parallelized it (the TP plan of whichever transformers release is
installed, `parallelize_module` by hand, FSDP2 over either) is the plan read. The blocks become boxes of
the checkpoint's tensors and are read in one request (the service) or one planned stream (any other
source), straight into the local tensors where dtype and layout allow. Before a byte is read, every
tensor of the model must be in the checkpoint with its global shape; else one `PlanError` names them.
A plain (non-DTensor) tensor is taken to hold all of its tensor: TP layers that keep plain local
shards (reshard's own) are filled from their rank's shard (`follow="shard"`).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from reshard.errors import PlanError
from reshard.fill.box_fill import read_boxes_into
from reshard.fill.held_boxes import held_blocks, landing, local_tensor
from reshard.fill.report import FillReport
from reshard.fill.stored_names import Fused, boxes_of, stored_names
from reshard.format.box_request import Box
from reshard.format.torch_side import TORCH_DTYPES
from reshard.io.client.box_client import is_service_url, tensor_listing

__all__ = ["fill_by_boxes"]

_LIST = 6


def fill_by_boxes(model: nn.Module, source: str | os.PathLike[str], *, token: str | None = None,
                  timeout: float = 60.0) -> FillReport:
    """Fill every parameter and persistent buffer of `model` with the blocks of `source`'s tensors its
    local tensors hold (the module docstring). `source`: the service's checkpoint URL, a checkpoint or
    rank-file directory, local or in a store."""
    t0 = time.perf_counter()
    listing, _config, opened = tensor_listing(source, token=token)
    stored = stored_names(listing, model=model)
    state = model.state_dict(keep_vars=True)
    _check(state, stored, str(source))
    boxes: list[Box] = []
    outs: list[torch.Tensor] = []
    casts: dict[str, tuple[str, str]] = {}
    seen: set[int] = set()
    fused = 0
    for name, t in state.items():
        if id(t) in seen:  # a tied alias: filled with its twin
            continue
        seen.add(id(t))
        local = local_tensor(t)
        if TORCH_DTYPES[stored[name].dtype] != local.dtype:  # torch's dtype names, as the shard path's report
            casts[name] = (str(TORCH_DTYPES[stored[name].dtype]).removeprefix("torch."),
                           str(local.dtype).removeprefix("torch."))
        for offsets, sizes, at in held_blocks(t) if local.numel() else ():
            for box, land, land_sizes in boxes_of(stored[name], offsets, sizes):
                boxes.append(box)
                outs.append(landing(local, tuple(map(int.__add__, at, land)), land_sizes, len(box.sizes)))
                fused += isinstance(stored[name], Fused)
    with torch.no_grad():
        received = read_boxes_into(opened if opened is not None else source, boxes, outs, token=token,
                                   timeout=timeout)
    rank, world = _rank_and_world()
    return FillReport(str(source), rank, world, len(boxes), received, time.perf_counter() - t0, casts, fused,
                      verified="sha256" if is_service_url(source) else "none")


def _check(state: dict[str, torch.Tensor], stored: dict[str, object], source: str) -> None:
    """`PlanError` unless every tensor of the model is in the checkpoint with its global shape."""
    missing = sorted(n for n in state if n not in stored)
    wrong = [f"{n}: the model's global shape {list(t.shape)}, the checkpoint's {list(stored[n].shape)}"  # type: ignore[attr-defined]
             for n, t in state.items() if n in stored and tuple(t.shape) != stored[n].shape]  # type: ignore[attr-defined]
    if missing or wrong:
        more = f" and {len(missing) - _LIST} more" if len(missing) > _LIST else ""
        problems = ([f"not in the checkpoint: {', '.join(missing[:_LIST])}{more}"] if missing else []) + wrong[:_LIST]
        raise PlanError(f"{source}: model and checkpoint disagree, nothing was filled: " + "; ".join(problems))


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

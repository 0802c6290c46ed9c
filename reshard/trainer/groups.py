"""The process groups of a data x tensor parallel run, as transformers' device meshes number ranks.

world = dp x tp; the tp ranks of one replica are consecutive global ranks (tp innermost):

    tp_rank = rank % tp        dp_rank = rank // tp

Every rank joins every group's creation (`new_group` is collective), then keeps its own two. A
dimension of size 1 has no group (None for tp means the whole world when dp is 1, as the TP layers
expect; None for dp means there is nothing to average).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from reshard.errors import ReshardError


@dataclass(frozen=True)
class DataTensorGroups:
    """This rank's place in a dp x tp run and the groups it belongs to."""

    dp: int
    tp: int
    dp_rank: int
    tp_rank: int
    dp_group: ProcessGroup | None
    tp_group: ProcessGroup | None

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp}


def make_groups(dp: int, *, world: int, rank: int) -> DataTensorGroups:
    """The dp x tp groups of a world of `world` ranks (tp = world // dp); collective when world > 1."""
    if dp < 1 or world % dp:
        raise ReshardError(f"--dp {dp}: the world of {world} ranks is not a multiple of it; "
                           f"pick --dp among {[d for d in range(1, world + 1) if world % d == 0]}")
    tp = world // dp
    tp_group = dp_group = None
    if dp > 1:
        for d in range(dp):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
            tp_group = g if d == rank // tp else tp_group
        for t in range(tp):
            g = dist.new_group(list(range(t, world, tp)))
            dp_group = g if t == rank % tp else dp_group
    return DataTensorGroups(dp, tp, rank // tp, rank % tp, dp_group, tp_group)


def average_gradients(params: list[torch.nn.Parameter], group: ProcessGroup | None, size: int) -> None:
    """Replace every gradient by its mean over `group` (the data-parallel replicas); no-op at size 1."""
    if size == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad.div_(size)


def mean_over(value: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
    """The mean of a scalar over `group` (a fresh tensor); the value itself at size 1."""
    if size == 1:
        return value.detach()
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out / size


def all_gather_json(obj: Any, group: ProcessGroup | None, *, device: torch.device | str = "cpu") -> list[Any]:
    """`obj` of every rank of `group` (JSON-encoded bytes over the wire: no pickle), by group rank;
    `device` is where the collective's tensors live (CUDA under NCCL)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([len(data)], device=device), group=group)
    width = max(int(s) for s in sizes)
    bufs = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(bufs, torch.cat([data, data.new_zeros(width - len(data))]), group=group)
    return [json.loads(bytes(b[: int(n)].cpu().tolist())) for b, n in zip(bufs, sizes, strict=True)]


__all__ = ["DataTensorGroups", "all_gather_json", "average_gradients", "make_groups", "mean_over"]

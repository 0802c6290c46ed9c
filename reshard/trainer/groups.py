"""The process groups of a data x FSDP x tensor parallel run, as transformers' device meshes number ranks.

world = dp x fsdp x tp, tp innermost, then fsdp, then dp (`reshard.layout.mesh.Layout`'s order):

    tp_rank = rank % tp        fsdp_rank = rank // tp % fsdp        dp_rank = rank // (tp * fsdp)

The dp x fsdp ranks sharing a tp rank are its data ranks (each reads its own share of the global
batch); `replicas` = dp x fsdp copies of the TP model are built, one per (dp, fsdp) coordinate. Every
rank joins every group's creation (`new_group` is collective), then keeps its own. A dimension of size
1 has no group (None for tp means the whole world when there is one replica, as the TP layers expect;
None for dp means there is nothing to average). At fsdp > 1 the (dp, fsdp) device mesh of the rank's
tp coordinate is what `fully_shard` shards over (`reshard.trainer.fsdp`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from reshard.errors import ReshardError
from reshard.layout.mesh import Layout


@dataclass(frozen=True)
class DataTensorGroups:
    """This rank's place in a dp x tp run and the groups it belongs to."""

    dp: int
    tp: int
    dp_rank: int
    tp_rank: int
    dp_group: ProcessGroup | None
    tp_group: ProcessGroup | None
    fsdp: int = 1
    fsdp_rank: int = 0
    data_group: ProcessGroup | None = None  # the dp x fsdp ranks of this tp rank (the loss's mean)
    fsdp_mesh: DeviceMesh | None = None  # (fsdp,) or (dp, fsdp) of this tp rank: what fully_shard shards over
    shard_group: ProcessGroup | None = None  # the fsdp x tp ranks of this replica: one copy of the model

    @property
    def files(self) -> Layout:
        """The layout of the rank files this rank fills from and saves (fsdp x tp: dp replicas share them)."""
        return Layout(fsdp=self.fsdp, tp=self.tp)

    @property
    def file_rank(self) -> int:
        """This rank's rank in `files`."""
        return self.fsdp_rank * self.tp + self.tp_rank

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp} if self.fsdp == 1 else {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp}

    @property
    def replicas(self) -> int:
        """The data ranks of a tp rank (dp x fsdp): how many copies of the TP model are built."""
        return self.dp * self.fsdp

    @property
    def data_rank(self) -> int:
        """This rank's place among its tp rank's `replicas` (which share of the global batch it reads)."""
        return self.dp_rank * self.fsdp + self.fsdp_rank

    @property
    def fsdp_group(self) -> ProcessGroup | None:
        """The ranks sharing this rank's parameters (None at fsdp=1)."""
        return None if self.fsdp_mesh is None else self.fsdp_mesh.get_group("fsdp")


def make_groups(dp: int, *, world: int, rank: int, fsdp: int = 1, device_type: str = "cpu") -> DataTensorGroups:
    """The dp x fsdp x tp groups of a world of `world` ranks (tp = world // (dp x fsdp)); collective when
    world > 1. `device_type` is the device mesh's at fsdp > 1 ("cuda" under NCCL)."""
    if dp < 1 or fsdp < 1 or world % (dp * fsdp):
        what = f"--dp {dp}" if fsdp == 1 else f"--dp {dp} x --fsdp {fsdp}"
        raise ReshardError(f"{what}: the world of {world} ranks is not a multiple of it; pick sizes whose "
                           f"product is among {[d for d in range(1, world + 1) if world % d == 0]}")
    replicas = dp * fsdp
    tp = world // replicas
    tp_group = data_group = None
    if replicas > 1:
        for d in range(replicas):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
            tp_group = g if d == rank // tp else tp_group
        for t in range(tp):
            g = dist.new_group(list(range(t, world, tp)))
            data_group = g if t == rank % tp else data_group
    mesh = None
    if fsdp > 1:
        full = init_device_mesh(device_type, (dp, fsdp, tp), mesh_dim_names=("dp", "fsdp", "tp"))
        mesh = full["fsdp"] if dp == 1 else full["dp", "fsdp"]
    dp_group = data_group if fsdp == 1 else None  # at fsdp > 1, fully_shard averages over dp (HSDP)
    shard_group = tp_group
    if fsdp > 1 and dp > 1:
        copy = fsdp * tp
        for d in range(dp):
            g = dist.new_group(list(range(d * copy, (d + 1) * copy)))
            shard_group = g if d == rank // copy else shard_group
    elif fsdp > 1:
        shard_group = None  # the world
    return DataTensorGroups(dp, tp, rank // tp // fsdp, rank % tp, dp_group, tp_group, fsdp=fsdp,
                            fsdp_rank=rank // tp % fsdp, data_group=data_group, fsdp_mesh=mesh, shard_group=shard_group)


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

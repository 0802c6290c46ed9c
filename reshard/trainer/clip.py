"""Gradient clipping by the global norm of the unsharded model, computed from the TP shards.

Each rank holds slices of the global tensors, described by its shard (`rank_header.tensors[name]`:
`select`, the global indices per dim, and `shape`, the global shape). An element held by m ranks of
the TP group (a replicated norm weight: m = tp; a kv head shared by tp/kv ranks: m = tp/kv; a split
weight: m = 1) has the same gradient on each of them, so each rank weighs its squared gradient by 1/m,
and by 0 where the index is past the global size (tp padding). The weighted sums, all-reduced over the
TP group, are the squared norm of the unsharded model's gradient: at tp=1 it is
`torch.nn.utils.clip_grad_norm_`'s norm. The weights come from the selections of every TP rank,
exchanged once (as JSON) when the clipper is made.

Under FSDP (`reshard.trainer.fsdp`) each parameter is a DTensor sharded on dim 0 over the fsdp ranks,
and a rank's file describes its local parts: the same weights, from the selections of every fsdp x tp
rank of one replica, summed over all of them, count each element of the unsharded model once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from reshard.tp.comm import tp_world_size
from reshard.trainer.groups import all_gather_json
from reshard.trainer.names import local, shard_targets

Select = list[list[list[int]]]


@dataclass(frozen=True)
class _Piece:
    """One shard tensor's place in a parameter (a strided view of it) and its elements' weights."""

    param: nn.Parameter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    weight: float | torch.Tensor


def _held(select: Select, d: int) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in select[d]])


def _in(index: torch.Tensor, select: Select, d: int) -> torch.Tensor:
    return torch.stack([(index >= a) & (index < b) for a, b in select[d]]).any(0)


def element_weights(own: Select, shape: list[int], selects: list[Select]) -> float | torch.Tensor:
    """1 / (the number of `selects` holding it) for each element of `own`, 0 past `shape` (padding);
    a float when every element has the same weight, else a tensor broadcastable to own's shape."""
    vectors: list[list[torch.Tensor]] = [[] for _ in selects] + [[]]  # per other rank, then in-bounds
    for d in range(len(own)):
        index = _held(own, d)
        dim = [_in(index, s, d) for s in selects] + [index < shape[d]]
        if all(bool(v.all()) or not bool(v.any()) for v in dim):
            dim = [v[:1] for v in dim]  # constant along this dim: broadcast
        view = [1] * len(own)
        view[d] = -1
        for k, v in enumerate(dim):
            vectors[k].append(v.reshape(view).float())

    def product(vs: list[torch.Tensor]) -> torch.Tensor:
        out = torch.ones([1] * len(own))
        for v in vs:
            out = out * v
        return out

    holders = sum(product(vs) for vs in vectors[:-1])
    weight = product(vectors[-1]) / holders.clamp(min=1.0)
    return float(weight.flatten()[0]) if bool((weight == weight.flatten()[0]).all()) else weight


def _owner(params: list[nn.Parameter], starts: list[int], view: torch.Tensor) -> nn.Parameter | None:
    """The parameter whose memory (local part) `view` lies in (by address: mapped parameters may share a
    storage); `params` sorted by address, `starts` their addresses."""
    i = bisect.bisect_right(starts, view.data_ptr()) - 1
    if i < 0:
        return None
    p = local(params[i])
    return params[i] if view.data_ptr() < p.data_ptr() + p.numel() * p.element_size() else None


class GlobalGradNorm:
    """The unsharded model's gradient norm, from this rank's parameters (`norm`), and clipping by it.

    `group` holds the ranks of one copy of the model: the tp group, or the fsdp x tp ranks of one replica
    (`DataTensorGroups.shard_group`), whose files' selections say who holds what."""

    def __init__(self, model: nn.Module, *, group: ProcessGroup | None = None) -> None:
        header = model.rank_header
        specs = header.model_tensors()
        self.group, self.size = group, tp_world_size(group)
        device = local(next(model.parameters())).device
        selects = all_gather_json({n: s["select"] for n, s in specs.items()}, group, device=device)
        self.params = list(model.parameters())
        by_address = sorted((p for p in self.params if local(p).numel()), key=lambda p: local(p).data_ptr())
        starts = [local(p).data_ptr() for p in by_address]
        self.pieces: list[_Piece] = []
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        for name, view in shard_targets(model, specs).items():
            p = _owner(by_address, starts, view) if view.numel() else None
            key = (id(p), view.data_ptr(), tuple(view.shape))
            if p is None or key in seen:
                continue  # a buffer, or a tied parameter already counted
            seen.add(key)
            w = element_weights(specs[name]["select"], specs[name]["shape"], [s[name] for s in selects])
            offset = (view.data_ptr() - local(p).data_ptr()) // p.element_size()
            self.pieces.append(_Piece(p, tuple(view.shape), tuple(view.stride()), offset, w))

    def norm(self) -> torch.Tensor:
        """The global L2 norm of the current gradients (float32), the same on every rank of the group."""
        total = torch.zeros((), dtype=torch.float32, device=local(self.params[0]).device)
        for piece in self.pieces:
            if piece.param.grad is None:
                continue
            g, lp = local(piece.param.grad), local(piece.param)
            if g.stride() != lp.stride():
                g = torch.empty_strided(g.size(), lp.stride(), dtype=g.dtype, device=g.device).copy_(g)
            part = g.as_strided(piece.size, piece.stride, g.storage_offset() + piece.offset).float().pow(2)
            w = piece.weight
            total += part.sum() * w if isinstance(w, float) else (part * w.to(part.device)).sum()
        if self.size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total.sqrt()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as `clip_grad_norm_` does; the norm."""
        total = self.norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params:
            if p.grad is not None:
                local(p.grad).mul_(coef.to(p.grad.dtype))
        return total


__all__ = ["GlobalGradNorm", "element_weights"]

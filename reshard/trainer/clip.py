"""Gradient clipping by the global norm of the unsharded model, computed from the TP shards.

Each rank holds slices of the global tensors, described by its shard (`rank_header.tensors[name]`:
`select`, the global indices per dim, and `shape`, the global shape). An element held by m ranks of
the TP group (a replicated norm weight: m = tp; a kv head shared by tp/kv ranks: m = tp/kv; a split
weight: m = 1) has the same gradient on each of them, so each rank weighs its squared gradient by 1/m,
and by 0 where the index is past the global size (tp padding). The weighted sums, all-reduced over the
TP group, are the squared norm of the unsharded model's gradient: at tp=1 it is
`torch.nn.utils.clip_grad_norm_`'s norm. The weights come from the selections of every TP rank,
exchanged once (as JSON) when the clipper is made.
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
from reshard.trainer.names import shard_targets

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
    """The parameter whose memory `view` lies in (by address: mapped parameters may share a storage);
    `params` sorted by address, `starts` their addresses."""
    i = bisect.bisect_right(starts, view.data_ptr()) - 1
    if i < 0:
        return None
    p = params[i]
    return p if view.data_ptr() < p.data_ptr() + p.numel() * p.element_size() else None


class GlobalGradNorm:
    """The unsharded model's gradient norm, from this rank's parameters (`norm`), and clipping by it."""

    def __init__(self, model: nn.Module, *, group: ProcessGroup | None = None) -> None:
        header = model.rank_header
        specs = header.model_tensors()
        self.group, self.tp = group, tp_world_size(group)
        device = next(model.parameters()).device
        selects = all_gather_json({n: s["select"] for n, s in specs.items()}, group, device=device)
        self.params = list(model.parameters())
        by_address = sorted((p for p in self.params if p.numel()), key=lambda p: p.data_ptr())
        starts = [p.data_ptr() for p in by_address]
        self.pieces: list[_Piece] = []
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        for name, view in shard_targets(model, specs).items():
            p = _owner(by_address, starts, view) if view.numel() else None
            key = (id(p), view.data_ptr(), tuple(view.shape))
            if p is None or key in seen:
                continue  # a buffer, or a tied parameter already counted
            seen.add(key)
            w = element_weights(specs[name]["select"], specs[name]["shape"], [s[name] for s in selects])
            offset = (view.data_ptr() - p.data_ptr()) // p.element_size()
            self.pieces.append(_Piece(p, tuple(view.shape), tuple(view.stride()), offset, w))

    def norm(self) -> torch.Tensor:
        """The global L2 norm of the current gradients (float32), the same on every TP rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for piece in self.pieces:
            g = piece.param.grad
            if g is None:
                continue
            if g.stride() != piece.param.stride():
                g = torch.empty_strided(g.size(), piece.param.stride(), dtype=g.dtype, device=g.device).copy_(g)
            part = g.as_strided(piece.size, piece.stride, g.storage_offset() + piece.offset).float().pow(2)
            w = piece.weight
            total += part.sum() * w if isinstance(w, float) else (part * w.to(part.device)).sum()
        if self.tp > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total.sqrt()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as `clip_grad_norm_` does; the norm."""
        total = self.norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return total


__all__ = ["GlobalGradNorm", "element_weights"]

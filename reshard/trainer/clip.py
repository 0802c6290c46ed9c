"""Gradient clipping by the global norm of the unsharded model, computed from the TP shards.

Each rank holds slices of the global tensors, described by its shard (`rank_header.tensors[name]`:
`select`, the global indices per dim, and `shape`, the global shape). An element held by m ranks of
the TP group (a replicated norm weight: m = tp; a kv head shared by tp/kv ranks: m = tp/kv; a split
weight: m = 1) has the same gradient on each of them, so each rank weighs its squared gradient by 1/m,
and by 0 where the index is past the global size (tp padding). The weighted sums, all-reduced over the
TP group, are the squared norm of the unsharded model's gradient: at tp=1 it is
`torch.nn.utils.clip_grad_norm_`'s norm. The weights come from the selections of every TP rank,
exchanged once (as JSON) when the clipper is made.

Under FSDP (`reshard.trainer.fsdp`) each parameter is a DTensor sharded on dim 0 over the fsdp ranks:
`ShardedGradNorm` takes the per-element weights of the whole local tensor (`param_weights`, computed
before sharding) cut like the parameter, and sums over the fsdp ranks too, so each element of the
unsharded model still counts once.
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

    def param_weights(self) -> dict[int, float | torch.Tensor]:
        """id(parameter) -> the weight of each of its elements (a float when all share one, else a tensor
        of the parameter's shape): what `ShardedGradNorm` cuts like the sharded parameter."""
        out: dict[int, float | torch.Tensor] = {}
        for p in self.params:
            mine = [c for c in self.pieces if c.param is p]
            ws = {c.weight for c in mine if isinstance(c.weight, float)}
            if len(ws) == 1 and len(mine) == sum(1 for c in mine if isinstance(c.weight, float)) and \
                    sum(torch.Size(c.size).numel() for c in mine) == p.numel():
                out[id(p)] = ws.pop()
                continue
            dense = torch.zeros(p.shape, dtype=torch.float32)
            for c in mine:
                dense.as_strided(c.size, c.stride, c.offset).copy_(torch.as_tensor(c.weight).expand(c.size))
            out[id(p)] = dense
        return out


class ShardedGradNorm:
    """The unsharded model's gradient norm for FSDP-sharded (DTensor) parameters, and clipping by it:
    `weights` pairs each parameter with its elements' weights (a float, or a tensor cut like the
    parameter's local shard); the squared sums are all-reduced over each of `groups` (fsdp, then tp)."""

    def __init__(self, weights: list[tuple[nn.Parameter, float | torch.Tensor]], *,
                 groups: list[ProcessGroup | None]) -> None:
        self.weights, self.groups = weights, groups

    def norm(self) -> torch.Tensor:
        """The global L2 norm of the current gradients (float32), the same on every rank of the groups."""
        total = torch.zeros((), dtype=torch.float32, device=self.weights[0][0].device)
        for p, w in self.weights:
            if p.grad is None:
                continue
            part = p.grad.to_local().float().pow(2)
            total += part.sum() * w if isinstance(w, float) else (part * w.to(part.device)).sum()
        for group in self.groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total.sqrt()

    def clip(self, max_norm: float) -> torch.Tensor:
        """As `GlobalGradNorm.clip`, on each rank's shards of the gradients; the norm."""
        total = self.norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p, _ in self.weights:
            if p.grad is not None:
                p.grad.to_local().mul_(coef.to(p.grad.dtype))
        return total


__all__ = ["GlobalGradNorm", "ShardedGradNorm", "element_weights"]

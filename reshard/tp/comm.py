"""Tensor-parallel communication: the four autograd region ops and two group helpers.

Each op is a pair of collectives that are each other's adjoint, one in forward and one in backward:

    op                      forward                     backward
    copy_to_tp_region       identity                    all-reduce (sum)
    reduce_from_tp_region   all-reduce (sum)            identity
    gather_from_tp_region   all-gather, last dim        split, last dim (keep this rank's piece)
    scatter_to_tp_region    split, last dim             all-gather, last dim

`copy_to_tp_region` sits at a ColumnParallelLinear input (every rank holds the whole input, so the
partial input gradients are summed in backward); `reduce_from_tp_region` sits at a RowParallelLinear
output (the partial products are summed in forward, and the gradient of a sum is passed through).
Gather and scatter are only needed where a Column and a Row layer are not used as a pair.

The process group is always passed in (`None` means the default world group); there is no hidden
global rank state. At world size 1, including when `torch.distributed` is not initialized at all,
every op returns its input unchanged and no collective runs. Collectives never modify the tensors
handed to them (the op works on a copy), and only portable calls are used (`all_reduce`, list-form
`all_gather`), so the same code runs on gloo and NCCL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from reshard.errors import PlanError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "copy_to_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "tp_rank",
    "tp_world_size",
]


def tp_world_size(group: ProcessGroup | None = None) -> int:
    """Size of `group` (default: the world group); 1 when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of {group!r}")
    return size


def tp_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank within `group` (default: the world group); 0 when not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of {group!r}")
    return rank


# ---------------------------------------------------------------------------------------------
# Raw collectives (no autograd). Callers have already returned early at world size 1.


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum of `x` over the group, in a fresh tensor (`x` itself is left untouched)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _split_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous piece of `x` along the last dim (which must divide evenly)."""
    size, rank = tp_world_size(group), tp_rank(group)
    last = x.size(-1)
    if last % size != 0:
        raise PlanError(
            f"scatter_to_tp_region: last dim has size {last}, not divisible by tp={size}; "
            f"pad the last dim to a multiple of {size}"
        )
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenation of every rank's `x` along the last dim, in rank order."""
    size = tp_world_size(group)
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(pieces, x, group=group)
    return torch.cat(pieces, dim=-1)


# ---------------------------------------------------------------------------------------------
# Autograd functions. `group` travels as a non-tensor argument; its gradient slot is None.


class _CopyToTPRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTPRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: split along the last dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _ScatterToTPRegion(torch.autograd.Function):
    """Forward: split along the last dim (keep this rank's piece). Backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


# ---------------------------------------------------------------------------------------------
# Public ops.


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Enter a TP region (ColumnParallelLinear input).

    Forward: identity (every rank already holds the whole input).
    Backward: all-reduce (sum) of the input gradient, adding up each rank's partial `dy_k @ W_k`.
    """
    if tp_world_size(group) == 1:
        return x
    return _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Leave a TP region by summing partial results (RowParallelLinear output).

    Forward: all-reduce (sum) of the per-rank partial results.
    Backward: identity (the gradient of a sum w.r.t. each term is the gradient of the sum).
    """
    if tp_world_size(group) == 1:
        return x
    return _ReduceFromTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Leave a TP region by concatenating per-rank slices (ColumnParallelLinear gather_output).

    Forward: all-gather along the last dim, in rank order (every rank's `x` has the same shape).
    Backward: split the gradient along the last dim and keep this rank's piece.
    """
    if tp_world_size(group) == 1:
        return x
    return _GatherFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Enter a TP region by keeping this rank's slice (RowParallelLinear, input_is_parallel=False).

    Forward: split along the last dim (which must be divisible by the group size) and keep
    this rank's contiguous piece.
    Backward: all-gather the gradient along the last dim.
    """
    if tp_world_size(group) == 1:
        return x
    return _ScatterToTPRegion.apply(x, group)

"""Checks of the four region ops and of ops on a subgroup (see tp_checks.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reshard.errors import PlanError
from reshard.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    tp_rank,
    tp_world_size,
)
from tests.support.tp_checks import check, close, leaf, linear, randn, shard_state


@check
def check_group_helpers(rank: int, ws: int) -> None:
    assert (tp_world_size(), tp_rank()) == (ws, rank), (tp_world_size(), tp_rank())


@check
def check_copy_to_tp_region(rank: int, ws: int) -> None:
    x = randn(0, 2, 3, 4).requires_grad_()
    grads = [randn(100 + r, 2, 3, 4) for r in range(ws)]
    y = copy_to_tp_region(x)
    y.backward(grads[rank])
    close(y.detach(), x.detach(), "copy forward is the identity")
    close(x.grad, sum(grads), "copy backward is the all-reduce (sum) of every rank's gradient")
    close(grads[rank], randn(100 + rank, 2, 3, 4), "copy backward left the incoming gradient untouched")


@check
def check_reduce_from_tp_region(rank: int, ws: int) -> None:
    xs = [randn(10 + r, 2, 3, 4) for r in range(ws)]
    grads = [randn(200 + r, 2, 3, 4) for r in range(ws)]
    x = leaf(xs[rank])
    y = reduce_from_tp_region(x)
    y.backward(grads[rank])
    close(y.detach(), sum(xs), "reduce forward is the all-reduce (sum)")
    close(x.detach(), xs[rank], "reduce forward left its input untouched")
    close(x.grad, grads[rank], "reduce backward is the identity")


@check
def check_gather_from_tp_region(rank: int, ws: int) -> None:
    xs = [randn(20 + r, 2, 3, 3) for r in range(ws)]
    grad = randn(300, 2, 3, 3 * ws)
    x = leaf(xs[rank])
    y = gather_from_tp_region(x)
    y.backward(grad)
    close(y.detach(), torch.cat(xs, dim=-1), "gather forward is the all-gather along the last dim")
    close(x.grad, torch.chunk(grad, ws, dim=-1)[rank], "gather backward keeps this rank's split")


@check
def check_scatter_to_tp_region(rank: int, ws: int) -> None:
    full = randn(30, 2, 3, 4 * ws)
    grads = [randn(400 + r, 2, 3, 4) for r in range(ws)]
    x = leaf(full)
    y = scatter_to_tp_region(x)
    y.backward(grads[rank])
    base = randn(31, 4 * ws, 3)
    x_nc = leaf(base).t()  # non-contiguous input: [3, 4*ws]
    y_nc = scatter_to_tp_region(x_nc)
    y_nc.sum().backward()
    close(y.detach(), torch.chunk(full, ws, dim=-1)[rank], "scatter forward keeps this rank's split")
    close(x.grad, torch.cat(grads, dim=-1), "scatter backward is the all-gather along the last dim")
    close(y_nc.detach(), torch.chunk(base.t(), ws, dim=-1)[rank], "scatter of a non-contiguous input")
    try:
        scatter_to_tp_region(torch.zeros(2, 4 * ws + 1))
    except PlanError as e:
        assert f"tp={ws}" in str(e) and str(4 * ws + 1) in str(e), str(e)
    else:
        raise AssertionError("scatter of a non-divisible last dim did not raise PlanError")


@check
def check_subgroups(rank: int, ws: int) -> None:
    """Ops and an MLP on a group that is not the world: halves (groups of one rank at ws=2)."""
    half = ws // 2
    groups = [dist.new_group(list(range(start, start + half))) for start in range(0, ws, half)]
    group, members = groups[rank // half], list(range(rank // half * half, rank // half * half + half))
    sizes = (tp_world_size(group), tp_rank(group))
    reduced = reduce_from_tp_region(torch.full((3,), float(rank)), group)
    gathered = gather_from_tp_region(torch.full((2, 1), float(rank)), group)
    # Column -> gelu -> Row on the subgroup, against the unsharded block.
    up, down = linear(40, 6, 8, True), linear(42, 8, 6, True)
    col = ColumnParallelLinear(6, 8, group=group)
    row = RowParallelLinear(8, 6, group=group)
    col.load_state_dict(shard_state(up.state_dict(), "column", half, rank % half), strict=True)
    row.load_state_dict(shard_state(down.state_dict(), "row", half, rank % half), strict=True)
    x = randn(44, 2, 6)
    x_ref, x_par = leaf(x), leaf(x)
    y_ref, y = down(F.gelu(up(x_ref))), row(F.gelu(col(x_par)))
    y_ref.sum().backward()
    y.sum().backward()
    assert sizes == (half, rank % half), sizes
    close(reduced, torch.full((3,), float(sum(members))), "subgroup all-reduce sums only its members")
    close(gathered, torch.tensor([[float(m) for m in members]] * 2), "subgroup all-gather")
    close(y.detach(), y_ref.detach(), "subgroup MLP output")
    close(x_par.grad, x_ref.grad, "subgroup MLP input gradient")

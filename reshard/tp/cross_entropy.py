"""Cross-entropy over vocabulary-sharded logits, without gathering the vocabulary (as Megatron does).

Rank r holds the logits of the contiguous vocabulary slice [r*V_local, (r+1)*V_local). Per token:

    m   = all-reduce MAX of the local maxima                     (numerical stability)
    s   = all-reduce SUM of sum_j exp(z_j - m)                   (partition function)
    t   = all-reduce SUM of (z_label - m) on the rank holding the label, 0 elsewhere
    loss = log(s) - t

`s` and `t` travel in one all-reduce, so a call costs two collectives in forward and none in
backward: the gradient w.r.t. the local logits is (softmax_local - onehot_local) * dloss / n_valid,
computed from the saved local softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from reshard.tp.comm import tp_rank, tp_world_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: all-reduce MAX, then one all-reduce SUM of [sum-exp, target logit, label hits].
    Backward: no collective (each rank differentiates its own slice)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: ProcessGroup | None,
        ignore_index: int,
        vocab_size: int | None,
    ) -> torch.Tensor:
        size, rank = tp_world_size(group), tp_rank(group)
        n_local = logits.size(-1)
        start = rank * n_local
        z = logits.reshape(-1, n_local)
        flat = labels.reshape(-1).long()

        if vocab_size is not None and start + n_local > vocab_size:
            cols = torch.arange(start, start + n_local, device=z.device)
            z = z.masked_fill(cols >= vocab_size, float("-inf"))  # padded columns take no mass

        # A fully padded shard has local max -inf; the all-reduced max is finite.
        row_max = z.max(dim=-1).values
        if size > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - row_max.unsqueeze(-1)

        valid = flat != ignore_index
        local = flat - start
        in_shard = valid & (local >= 0) & (local < n_local)
        local = local.masked_fill(~in_shard, 0)
        target = shifted.gather(1, local.unsqueeze(1)).squeeze(1)
        target = torch.where(in_shard, target, torch.zeros_like(target))

        exp = shifted.exp_()  # `shifted` is a fresh tensor; reuse its memory
        stats = torch.stack([exp.sum(dim=-1), target, in_shard.to(exp.dtype)])
        if size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target, hits = stats.unbind(0)

        per_token = sum_exp.log() - target
        # A label that no rank holds (out of range, not ignore_index) gives NaN instead of a silent
        # wrong value; raising would need a host sync.
        per_token = torch.where(hits == 1, per_token, torch.full_like(per_token, float("nan")))
        per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
        n_valid = valid.sum()
        loss = per_token.sum() / n_valid  # NaN when every label is ignored, like F.cross_entropy

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, in_shard, valid, n_valid)
        ctx.logits_shape = logits.shape
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local, in_shard, valid, n_valid = ctx.saved_tensors
        grad = softmax  # modified in place; a second backward through this graph is refused by autograd
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local] -= in_shard.to(grad.dtype)
        scale = grad_loss / n_valid.clamp(min=1).to(grad.dtype)
        grad.mul_((valid.to(grad.dtype) * scale).unsqueeze(-1))
        return grad.view(ctx.logits_shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored labels, from this rank's slice of the vocabulary.

    `logits_shard` is `[..., V_local]`: this rank's contiguous slice of the last (vocabulary) dim,
    e.g. the output of `ColumnParallelLinear(..., gather_output=False)`; `labels` is `[...]` with
    global vocabulary ids or `ignore_index`. `vocab_size` is the true vocabulary when the shards were
    padded (`V_local * tp > vocab_size`): padded columns are treated as -inf. Computes in at least
    float32 (a bf16/fp16 input gives a float32 loss; the gradient has the input's dtype). Equal to
    `F.cross_entropy(full_logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index)`.
    At world size 1 no process group is needed.
    """
    if logits_shard.dim() < 1 or tuple(labels.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: labels shape {tuple(labels.shape)} must equal the logits "
            f"shape without its last dim, {tuple(logits_shard.shape[:-1])}"
        )
    if vocab_size is not None:
        total = logits_shard.size(-1) * tp_world_size(group)
        if not 0 < vocab_size <= total:
            raise ValueError(
                f"vocab_parallel_cross_entropy: vocab_size={vocab_size} must be in (0, {total}] "
                f"(local vocab {logits_shard.size(-1)} x tp={tp_world_size(group)})"
            )
    compute_dtype = torch.promote_types(logits_shard.dtype, torch.float32)
    return _VocabParallelCrossEntropy.apply(
        logits_shard.to(compute_dtype), labels, group, ignore_index, vocab_size
    )

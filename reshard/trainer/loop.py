"""The training loop of the bundled trainer: global batches, gradient averaging, clipping, the schedule.

The loop's whole position is a `RunState` (steps taken, the global data cursor, the seed); with the
model, the optimizer and the schedule (`reshard.trainer.schedule`) it is everything a checkpoint
needs to continue the run. One step:

    samples [cursor + offset, + B/D)  ->  loss, backward  ->  gradients averaged over the D replicas
      ->  clipped by the global norm (optional)  ->  AdamW step at the schedule's lr  ->  cursor += B

The loss reported is the global batch's mean (each replica's mean, averaged over the replicas: the
replicas' shares have the same number of tokens). At fsdp > 1 the D = dp x fsdp data ranks share the
batch, `fully_shard` reduce-scatters (and averages) the gradients itself, and the clipper sums over the
fsdp x tp ranks of one replica (`DataTensorGroups.shard_group`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from reshard.trainer.clip import GlobalGradNorm
from reshard.trainer.cursor import local_share, sample_windows
from reshard.trainer.groups import DataTensorGroups, average_gradients, mean_over
from reshard.trainer.loss import causal_lm_loss
from reshard.trainer.names import local


@dataclass
class RunState:
    """Where a run is: optimizer steps taken, global samples consumed (the data cursor), the data seed."""

    step: int = 0
    samples: int = 0
    seed: int = 0


@dataclass(frozen=True)
class StepRecord:
    """What one step did: its 1-based number, the global batch's loss, the lr used, the gradient norm."""

    step: int
    loss: float
    lr: float
    grad_norm: float | None = None


@dataclass(frozen=True)
class LoopOptions:
    """The loop's settings: `steps` is the run's total, `batch_size` the global batch."""

    steps: int
    batch_size: int
    seq_len: int
    max_norm: float | None = None
    on_step: Callable[[StepRecord], None] | None = field(default=None, compare=False)


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, state: RunState,
    tokens: torch.Tensor, *, groups: DataTensorGroups, options: LoopOptions,
) -> list[StepRecord]:
    """Run from `state.step` to `options.steps`, advancing `state`; one record per step taken."""
    device = local(next(model.parameters())).device
    offset, count = local_share(options.batch_size, groups.replicas, groups.data_rank)
    clipper = GlobalGradNorm(model, group=groups.shard_group) if options.max_norm is not None else None
    params = [p for p in model.parameters() if p.requires_grad]
    records = []
    while state.step < options.steps:
        window = sample_windows(tokens, seed=state.seed, first=state.samples + offset, count=count,
                                seq_len=options.seq_len).to(device)
        loss = causal_lm_loss(model, window[:, :-1], window[:, 1:])
        loss.backward()
        if groups.fsdp == 1:  # fully_shard reduces the gradients itself
            average_gradients(params, groups.dp_group, groups.dp)
        norm = clipper.clip(options.max_norm) if clipper is not None else None
        lr = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.samples += options.batch_size
        record = StepRecord(state.step, mean_over(loss, groups.data_group, groups.replicas).item(), lr,
                            None if norm is None else norm.item())
        records.append(record)
        if options.on_step is not None:
            options.on_step(record)
    return records


__all__ = ["LoopOptions", "RunState", "StepRecord", "train_steps"]

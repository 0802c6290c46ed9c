"""The optimizer and its learning-rate schedule: linear warmup, then cosine decay to a floor.

    lr(s) = lr * s / warmup                                          s < warmup
    lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,          p = (s - warmup) / (steps - 1 - warmup)

for the optimizer step `s` (0-based) of a run of `steps`: from 0 up to `lr` over `warmup` steps, then
down to `min_lr` at the last step. With no warmup and `min_lr = lr` (the defaults) the rate is
constant. The schedule is a `torch.optim.lr_scheduler.LambdaLR`, so its position is its
`state_dict()` (`last_epoch`: the steps taken), which a checkpoint saves and a resume loads.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from reshard.errors import ReshardError


def lr_factor(step: int, *, steps: int, warmup: int = 0, lr: float, min_lr: float | None = None) -> float:
    """The multiple of `lr` used at optimizer step `step` (0-based) of a run of `steps`."""
    floor = lr if min_lr is None else min_lr
    if step < warmup:
        return step / warmup
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return (floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))) / lr


def check_schedule(*, steps: int, warmup: int, lr: float, min_lr: float | None) -> None:
    """`ReshardError` (one line) for a schedule that cannot be run."""
    if warmup < 0 or steps < 0:
        raise ReshardError(f"--warmup {warmup} / --steps {steps}: need warmup >= 0 and steps >= 0")
    if lr <= 0 or (min_lr is not None and not 0 <= min_lr <= lr):
        raise ReshardError(f"--lr {lr} / --min-lr {min_lr}: need lr > 0 and 0 <= min-lr <= lr")


def make_optimizer(model: nn.Module, *, lr: float) -> torch.optim.AdamW:
    """AdamW over the model's parameters (no weight decay), as the bundled trainer uses it."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, steps: int, warmup: int = 0, min_lr: float | None = None,
) -> LambdaLR:
    """The warmup + cosine schedule over `steps` on `optimizer` (its `lr` is the peak rate)."""
    lr = optimizer.param_groups[0]["lr"]
    check_schedule(steps=steps, warmup=warmup, lr=lr, min_lr=min_lr)
    return LambdaLR(optimizer, lambda s: lr_factor(s, steps=steps, warmup=warmup, lr=lr, min_lr=min_lr))


__all__ = ["check_schedule", "lr_factor", "make_optimizer", "make_scheduler"]

"""Shard tensor names (the names on disk) -> the trainer model's tensors they fill and are saved from.

The model is transformers' own, so its conversion mapping says where each name on disk goes
(`reshard.fill.experts.shard_layout`): renamed keys to the tensor of that name, per-expert MoE tensors to
views of the fused expert parameters (`reshard.fill.experts.expert_views`). The trainer's tensors are plain
(a fused parameter is this rank's local shape), so the views are contiguous blocks the fill writes
shard bytes straight into, and `save_rank_shard` reads them back under the names on disk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from reshard.errors import PlanError
from reshard.fill.experts import expert_views, partly_covered, shard_layout, uncovered
from reshard.format.selection import selection_shape

Spec = dict[str, Any]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local tensor of a DTensor (an FSDP-sharded parameter), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_targets(model: nn.Module, specs: dict[str, Spec]) -> dict[str, torch.Tensor]:
    """Shard tensor name -> the model tensor (or fused-parameter view) it fills and is saved from.

    Every parameter and persistent buffer of the model must be covered exactly by the shard. Under FSDP
    (DTensor parameters) the targets are views of this rank's local parts, and `specs` those of its file.
    """
    layout = shard_layout(model, list(specs))
    parts: dict[int, torch.Tensor] = {}  # one local part per tensor: a tied pair stays one tensor
    own = {n: parts.setdefault(id(t), local(t))
           for n, t in {**dict(model.named_parameters()), **model.state_dict(keep_vars=True)}.items()}
    targets = {n: own[m] for n, m in layout.renamed.items() if m in own}
    shapes = {n: selection_shape(specs[n]["select"]) for n in layout.pieces}
    views = expert_views(own, layout.pieces, shapes)
    targets.update((n, v.view) for n, v in views.items())
    partly = partly_covered(views)
    if partly:
        raise PlanError(f"shard and model disagree ({type(model).__name__}): {'; '.join(partly)}")
    missing, unknown = uncovered(own, layout, views, specs)
    if missing or unknown:
        raise PlanError(f"shard and model disagree: the model's {missing[:3]} are not in the shard, "
                        f"the shard's {unknown[:3]} are not in the model ({type(model).__name__})")
    return targets


__all__ = ["local", "shard_targets"]

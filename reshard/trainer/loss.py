"""The training loss on vocab-sharded logits: the full vocabulary is never gathered."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reshard.tp import ColumnParallelLinear, vocab_parallel_cross_entropy


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; with a column-parallel `lm_head`, from this rank's logits only."""
    hidden = model.hidden_states(input_ids)
    head = model.lm_head
    if isinstance(head, ColumnParallelLinear):
        return vocab_parallel_cross_entropy(head.forward_local(hidden), labels, group=head.group,
                                            vocab_size=head.out_features)
    logits = head(hidden)
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())

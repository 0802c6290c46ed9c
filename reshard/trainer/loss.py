"""The training loss on vocab-sharded logits: the full vocabulary is never gathered.

The model's own forward computes the logits (so soft-capping, logit scaling and the like are
transformers' own), with a column-parallel head left un-gathered for that call: each rank gets its
vocabulary slice, and `vocab_parallel_cross_entropy` combines them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reshard.tp import ColumnParallelLinear, vocab_parallel_cross_entropy


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; with a column-parallel output head, from this rank's logits only."""
    head = model.get_output_embeddings()
    if not isinstance(head, ColumnParallelLinear):
        logits = model(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
    gather, head.gather_output = head.gather_output, False
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        head.gather_output = gather
    return vocab_parallel_cross_entropy(logits, labels, group=head.group, vocab_size=head.out_features)

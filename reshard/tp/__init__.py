"""Tensor parallelism: communication region ops, parallel layers and vocab-parallel cross-entropy.

Everything takes the process group as an argument (default: the world group) and degrades to plain
single-process math at world size 1, with or without an initialized process group.
"""

from reshard.tp.comm import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    tp_rank,
    tp_world_size,
)
from reshard.tp.cross_entropy import vocab_parallel_cross_entropy
from reshard.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "tp_rank",
    "tp_world_size",
    "vocab_parallel_cross_entropy",
]

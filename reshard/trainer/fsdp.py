"""`--fsdp F`: the TP model's parameters and AdamW state sharded over F ranks with torch's `fully_shard`.

The TP layers hold plain local tensors, so FSDP2 shards each rank's local tensor on dim 0 over the
ranks of its tp coordinate (`DataTensorGroups.fsdp_mesh`: (fsdp,), or (dp, fsdp) for HSDP, which also
averages the gradients over dp). The parallel layers use `self.weight` in their forward, which FSDP2's
pre-forward all-gather makes whole again; its backward reduce-scatters (and averages) the gradients.

`shard_layers` is `build_model`'s `shard` step: it runs on the meta model, after the TP swap and before
`to_empty`, so a rank materializes and fills only its dim-0 chunks: those of its rank file of fsdp x tp
(`reshard.layout`'s FSDP cut is torch.chunk's on dim 0 of the tp rank's tensor, as `fully_shard`'s).
The optimizer's moments are DTensors like their parameters; a save writes every rank's local parts as
its rank file of fsdp x tp, nothing gathered, and a resume reads them back (or cuts them from another
layout) the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import fully_shard

from reshard.errors import ReshardError
from reshard.trainer.adjust import GRAD_SUM
from reshard.trainer.groups import DataTensorGroups

__all__ = ["shard_layers"]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (each its own FSDP unit: one layer's parameters are whole at a time)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers"):
            return list(module)
    return []


def shard_layers(groups: DataTensorGroups) -> Callable[[nn.Module], None]:
    """`fully_shard` each decoder layer, then the model, over `groups.fsdp_mesh`: the step `build_model`
    runs on the meta model (its `shard`)."""
    mesh = groups.fsdp_mesh
    assert mesh is not None, "shard_layers needs the groups of --fsdp > 1"

    def shard(model: nn.Module) -> None:
        hooked = [n for n, m in model.named_modules() if hasattr(m, GRAD_SUM)]
        if hooked:
            raise ReshardError(f"--fsdp {groups.fsdp}: {hooked[0]} sums its gradients over the tp ranks with a hook "
                               f"on the plain parameter, which fully_shard replaces; run this model with --fsdp 1 "
                               f"(--dp for data parallelism) or at tp=1")
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    return shard

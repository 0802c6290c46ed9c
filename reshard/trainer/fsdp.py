"""`--fsdp F`: the TP model's parameters and AdamW state sharded over F ranks with torch's `fully_shard`.

The TP layers hold plain local tensors, so FSDP2 shards each rank's local tensor on dim 0 over the
ranks of its tp coordinate (`DataTensorGroups.fsdp_mesh`: (fsdp,), or (dp, fsdp) for HSDP, which also
averages the gradients over dp). The parallel layers use `self.weight` in their forward, which FSDP2's
pre-forward all-gather makes whole again; its backward reduce-scatters (and averages) the gradients.

The model is built and filled (and a resume restores its moments) as at fsdp=1; `shard_model` then
shards it and moves the optimizer's state onto the sharded parameters, each rank keeping its dim-0
chunk of the moments. A save gathers each tp rank's parameters and moments back over its fsdp ranks
(`gathered`: every fsdp rank holds one TP rank's whole share for the length of the save) and writes
the tp rank files of fsdp=1: the checkpoint is the one a tp-only run writes.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from reshard.errors import ReshardError
from reshard.trainer.adjust import GRAD_SUM
from reshard.trainer.clip import GlobalGradNorm, ShardedGradNorm
from reshard.trainer.groups import DataTensorGroups

__all__ = ["gathered", "shard_model"]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (each its own FSDP unit: one layer's parameters are whole at a time)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers"):
            return list(module)
    return []


def _check(model: nn.Module, groups: DataTensorGroups) -> None:
    hooked = [n for n, m in model.named_modules() if hasattr(m, GRAD_SUM)]
    if hooked:
        raise ReshardError(f"--fsdp {groups.fsdp}: {hooked[0]} sums its gradients over the tp ranks with a hook "
                           f"on the plain parameter, which fully_shard replaces; run this model with --fsdp 1 "
                           f"(--dp for data parallelism) or at tp=1")


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer, *, groups: DataTensorGroups,
                clip: bool = False) -> ShardedGradNorm | None:
    """`fully_shard` each decoder layer, then the model, over `groups.fsdp_mesh`; the optimizer's params
    and state (restored or not) move onto the sharded parameters. With `clip`, the clipper of the sharded
    model (its weights computed from the whole local tensors, before sharding)."""
    _check(model, groups)
    mesh = groups.fsdp_mesh
    assert mesh is not None, "shard_model needs the groups of --fsdp > 1"
    names = {id(p): n for n, p in model.named_parameters()}
    weights = GlobalGradNorm(model, group=groups.tp_group).param_weights() if clip else {}
    by_name = {names[id(p)]: weights.get(id(p), 0.0) for p in model.parameters()}
    states = {names[id(p)]: optimizer.state[p] for p in model.parameters() if p in optimizer.state}
    order = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = dict(model.named_parameters())
    for g, ns in zip(optimizer.param_groups, order, strict=True):
        g["params"] = [sharded[n] for n in ns]
    optimizer.state = defaultdict(dict)
    for n, state in states.items():
        optimizer.state[sharded[n]] = {k: _shard_like(v, sharded[n]) for k, v in state.items()}
    if not clip:
        return None
    cut = [(p, w if isinstance(w, float) else _local_rows(w, p, groups)) for n, p in sharded.items()
           for w in [by_name[n]]]
    tp = [groups.tp_group] if groups.tp > 1 else []
    return ShardedGradNorm(cut, groups=[groups.fsdp_group, *tp])


def _shard_like(value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """A moment (the whole local tensor, the same on every fsdp rank) as `param` is sharded: this rank's
    chunk, no communication; a scalar (AdamW's step) as it is."""
    if value.dim() == 0 or not isinstance(param, DTensor):
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def _local_rows(weight: torch.Tensor, param: DTensor, groups: DataTensorGroups) -> torch.Tensor:
    """The rows of the whole tensor `weight` this rank holds of `param` (Shard(0): torch.chunk's cut)."""
    chunks = weight.chunk(groups.fsdp, dim=0)
    local = chunks[groups.fsdp_rank] if groups.fsdp_rank < len(chunks) else weight[:0]
    if local.shape != param.to_local().shape:
        raise ReshardError(f"--fsdp {groups.fsdp}: a parameter's shard has shape {list(param.to_local().shape)}, "
                           f"not the {list(local.shape)} of dim-0 chunks; run with --fsdp 1")
    return local


@contextlib.contextmanager
def gathered(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    """For a save: the model (as it is when not sharded) with its whole local (one tp rank's) parameters in place of the sharded ones,
    and an AdamW (hyperparameters and state of `optimizer`) holding whole moments; put back on exit.
    A collective over the fsdp ranks (each all-gathers every parameter and moment)."""
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        yield model, optimizer  # not sharded: as it is
        return
    swapped: dict[int, nn.Parameter] = {}
    put_back: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in swapped:
                    swapped[id(p)] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                put_back.append((module, name, p))
                module._parameters[name] = swapped[id(p)]
    try:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [swapped[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        twin = type(optimizer)(groups)
        for g, tg in zip(optimizer.param_groups, twin.param_groups, strict=True):
            for p, tp in zip(g["params"], tg["params"], strict=True):
                if p in optimizer.state:
                    twin.state[tp] = {k: v.full_tensor() if isinstance(v, DTensor) else v
                                      for k, v in optimizer.state[p].items()}
        yield model, twin
    finally:
        for module, name, p in put_back:
            module._parameters[name] = p

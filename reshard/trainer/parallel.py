"""Parallelize a meta-device model: swap each module for the parallel layer of its weight's kind.

The kinds come from the rank shard's self-description, i.e. from the same manifest that resharded
the checkpoint, and each kind's layer is looked up in the registry (`register_layer`), next to its
loader. The model file itself knows nothing of this.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from reshard.fill.experts import shard_layout
from reshard.format.selection import selection_shape
from reshard.rules.kinds import layer_factory, register_layer
from reshard.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp_region
from reshard.tp.comm import tp_rank, tp_world_size
from reshard.trainer.adjust import adjust
from reshard.trainer.parallel_experts import parallelize_experts

Spec = dict[str, Any]


def _local_rows(spec: Spec) -> int:
    return selection_shape(spec["select"])[0]


class HeadReplicatedLinear(nn.Module):
    """A column-parallel projection with heads fewer than tp: each such head lives on tp/heads ranks.

    The local output is `blocks` of rows, each (rows, share_group): a block whose heads are shared
    has the group of ranks holding it, a split block None (a fused q|k|v of Phi-3 mixes both). Forward:
    identity into the region (input gradient all-reduced, as for a column layer). The weight gradient
    of a shared block is summed over its sharers (`copy_to_tp_region` over the share group).
    `out_split` gives the local block widths, for a model that splits a fused output.
    """

    def __init__(self, in_features: int, blocks: list[tuple[int, ProcessGroup | None]], bias: bool, *,
                 group: ProcessGroup | None, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group = group
        self.out_split = [rows for rows, _ in blocks]
        self.share_groups = [g for _, g in blocks]
        local_out = sum(self.out_split)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local_out, device=device, dtype=dtype)) if bias else None

    def _shared(self, t: torch.Tensor) -> torch.Tensor:
        if len(self.out_split) == 1:
            return copy_to_tp_region(t, self.share_groups[0]) if self.share_groups[0] is not None else t
        parts = t.split(self.out_split)
        return torch.cat([copy_to_tp_region(p, g) if g is not None else p for p, g in zip(parts, self.share_groups)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self._shared(self.bias) if self.bias is not None else None
        return F.linear(copy_to_tp_region(x, self.group), self._shared(self.weight), bias)


# groups of ranks sharing a head, made once per head count while one `parallelize` call runs
_SHARE_GROUPS: contextvars.ContextVar[dict[int, ProcessGroup | None]] = contextvars.ContextVar("share_groups")


def _share_groups(heads: int, group: ProcessGroup | None) -> ProcessGroup | None:
    """This rank's group of the ranks sharing its head, created by those ranks alone
    (`use_local_synchronization`: a group's name is a hash of its ranks, so replicas of the TP group, or any
    other ranks, never need to join its creation)."""
    cache = _SHARE_GROUPS.get(None)
    if cache is not None and heads in cache:
        return cache[heads]
    tp, rank = tp_world_size(group), tp_rank(group)
    rep = tp // heads
    members = list(range(rank // rep * rep, (rank // rep + 1) * rep))
    global_ranks = [dist.get_global_rank(group, r) for r in members] if group is not None else members
    mine = dist.new_group(global_ranks, use_local_synchronization=True)
    if cache is not None:
        cache[heads] = mine
    return mine


@register_layer("column")
def _column_layer(module: nn.Module, spec: Spec, group: ProcessGroup | None) -> nn.Module:
    out, inn = spec["shape"]
    tp, local = tp_world_size(group), _local_rows(spec)
    opts = spec.get("options") or {}
    bias = getattr(module, "bias", None) is not None
    factory = {"device": "meta", "dtype": module.weight.dtype}
    heads = opts.get("heads")
    if opts.get("replicate_heads") and heads and heads < tp:  # GQA kv heads shared by tp/heads ranks
        return HeadReplicatedLinear(inn, [(local, _share_groups(heads, group))], bias, group=group, **factory)
    return ColumnParallelLinear(inn, out, bias, gather_output=bool(opts.get("gather_output")),
                                padded_out_features=local * tp, group=group, **factory)


@register_layer("packed_column")
def _packed_layer(module: nn.Module, spec: Spec, group: ProcessGroup | None) -> nn.Module:
    out, inn = spec["shape"]
    tp, opts = tp_world_size(group), spec.get("options") or {}
    bias = getattr(module, "bias", None) is not None
    factory = {"device": "meta", "dtype": module.weight.dtype}
    heads = opts.get("heads") or [None] * len(opts.get("blocks", ()))
    replicate = opts.get("replicate_heads") or [False] * len(heads)
    shared = [bool(r and h and h < tp) for h, r in zip(heads, replicate)]
    if not any(shared):
        return ColumnParallelLinear(inn, out, bias, group=group, **factory)
    rows = [b - a for a, b in spec["select"][0]]  # one interval per block, in block order
    blocks = [(n, _share_groups(h, group) if s else None) for n, h, s in zip(rows, heads, shared)]
    return HeadReplicatedLinear(inn, blocks, bias, group=group, **factory)


@register_layer("row")
def _row_layer(module: nn.Module, spec: Spec, group: ProcessGroup | None) -> nn.Module:
    out, inn = spec["shape"]
    split_input = bool((spec.get("options") or {}).get("split_input"))  # HF `rowwise_split_input`: full input
    return RowParallelLinear(inn, out, getattr(module, "bias", None) is not None, input_is_parallel=not split_input,
                             group=group, device="meta", dtype=module.weight.dtype)


@register_layer("vocab_embed")
def _vocab_layer(module: nn.Module, spec: Spec, group: ProcessGroup | None) -> nn.Module:
    vocab, dim = spec["shape"]
    return VocabParallelEmbedding(vocab, dim, padded_num_embeddings=_local_rows(spec) * tp_world_size(group),
                                  padding_idx=getattr(module, "padding_idx", None), group=group, device="meta",
                                  dtype=module.weight.dtype)


def parallelize(model: nn.Module, specs: dict[str, Spec], *, group: ProcessGroup | None = None,
                tied: tuple[str, str] | None = None) -> nn.Module:
    """Swap every module whose `.weight` has a non-replicate kind in `specs` (shard name ->
    self-description; names on disk, mapped to the model's by `shard_layout`), parallelize fused MoE
    experts, then adjust what the forward reads from global sizes (`adjust`).

    `tied=(head, embedding)` names an output head that shares the embedding's weight and so has no
    entry of its own: it becomes a gathered column-parallel layer split like the embedding.
    Works on a model built on the meta device; nothing is allocated.
    """
    token = _SHARE_GROUPS.set({})
    try:
        originals = dict(model.named_modules())
        layout = shard_layout(model, list(specs))
        by_model_name = layout.model_specs(specs)
        swapped = _swap(model, by_model_name, group, tied)
        parallelize_experts(model, layout, specs, group)
        adjust(model, originals, by_model_name, group, swapped)
        return model
    finally:
        _SHARE_GROUPS.reset(token)


def _swap(model: nn.Module, specs: dict[str, Spec], group: ProcessGroup | None,
          tied: tuple[str, str] | None) -> set[str]:
    specs = dict(specs)
    if tied and f"{tied[0]}.weight" not in specs and f"{tied[1]}.weight" in specs:
        emb = specs[f"{tied[1]}.weight"]
        if emb["kind"] != "replicate":
            specs[f"{tied[0]}.weight"] = {**emb, "kind": "column", "options": {"gather_output": True}}
    swapped = set()
    for name, module in list(model.named_modules()):
        spec = specs.get(f"{name}.weight")
        if spec is None or not isinstance(module, nn.Linear | nn.Embedding):
            continue
        factory = layer_factory(spec["kind"])
        if factory is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, factory(module, spec, group))
        swapped.add(name)
    return swapped

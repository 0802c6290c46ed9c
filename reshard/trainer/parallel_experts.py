"""Parallel MoE experts on transformers' fused expert parameters.

Per expert, gate and up are split like column layers and down like a row layer (the shard says so:
`mlp.experts.N.gate_proj.weight` column, `...down_proj.weight` row). The fused parameters
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) shrink to this rank's [E, 2I/tp, H] and
[E, H, I/tp] on the meta device; transformers' experts forward is unchanged: per expert, `chunk(2)`
of the local gate|up gives the local gate and up, and the local down projection gives a partial sum.
So the experts module's inputs (hidden states and routing weights) enter the TP region
(`copy_to_tp_region`: identity forward, gradient all-reduced, as each rank's is partial) and its output
is summed over ranks once (`reduce_from_tp_region`), after the routing weights and the scatter back to
tokens, which are linear. The router stays replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from reshard.errors import PlanError
from reshard.fill.experts import ExpertLayout
from reshard.format.selection import selection_shape
from reshard.tp import copy_to_tp_region, reduce_from_tp_region

Spec = dict[str, Any]


def parallelize_experts(model: nn.Module, layout: ExpertLayout, specs: dict[str, Spec], group: ProcessGroup | None) -> None:
    """Give every fused experts parameter this rank's shape (on meta); hook the modules that are split."""
    local: dict[str, dict[int, tuple[int, ...]]] = {}
    split: set[str] = set()
    for name, piece in layout.pieces.items():
        shape = selection_shape(specs[name]["select"])
        have = local.setdefault(piece.param, {}).setdefault(piece.source, shape)
        if have != shape:
            raise PlanError(f"{name}: local shape {list(shape)} differs from another expert's {list(have)}")
        if specs[name]["kind"] != "replicate":
            split.add(piece.param.rpartition(".")[0])
    for param_name, sources in local.items():
        piece = next(p for p in layout.pieces.values() if p.param == param_name)
        module_name, _, attr = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        old = getattr(module, attr)
        per_expert = list(sources[0])
        if piece.concat_dim is not None:
            per_expert[piece.concat_dim] = sum(s[piece.concat_dim] for s in sources.values())
        shape = (old.shape[0], *per_expert)
        if shape != tuple(old.shape):
            setattr(module, attr, nn.Parameter(torch.empty(shape, device="meta", dtype=old.dtype)))
    for module_name in sorted(split):
        _enter_and_reduce(model.get_submodule(module_name), group)


def _enter_and_reduce(module: nn.Module, group: ProcessGroup | None) -> None:
    def enter(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        # hidden states and routing weights: each rank's gradient w.r.t. them is partial (summed here)
        return tuple(copy_to_tp_region(a, group) if torch.is_tensor(a) and a.is_floating_point() else a
                     for a in args)

    def leave(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp_region(out, group)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
    down = getattr(module, "down_proj", None)
    if isinstance(getattr(module, "intermediate_dim", None), int) and isinstance(down, torch.Tensor):
        module.intermediate_dim = down.shape[-1]  # read by transformers' grouped experts kernels


__all__ = ["parallelize_experts"]

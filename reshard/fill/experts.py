"""Checkpoint tensor names -> a model's tensors, by transformers' conversion mapping (MoE experts fused).

transformers 5 renames some checkpoint keys on load (Mixtral's `block_sparse_moe.` -> `mlp.`, GPT-NeoX's
`embed_out` -> `lm_head`) and fuses others: a MoE layer's per-expert tensors become one 3-D parameter
per projection (`mlp.experts.gate_up_proj` [E, gate+up, H] from every `mlp.experts.N.gate_proj/up_proj
.weight`: MergeModulelist(dim=0) over experts, then Concatenate; `mlp.experts.down_proj` [E, H, I]).
Shards keep the names on disk, so both the trainer and `fill_model` read the model's own mapping
(`get_model_conversion_mapping`, `rename_source_key`) to place each shard tensor:

    layout = shard_layout(model, shard_names)     # renamed: disk name -> model name; pieces: fused ones
    views = expert_views(params, layout.pieces, shard_shapes)
    views["model.layers.0.mlp.experts.3.up_proj.weight"].view   # expert 3's up block of gate_up_proj

A view is a contiguous block of the fused parameter's (local) tensor, so a rank shard's bytes land
straight in it and are read back out of it under the names on disk. Where the fused parameter is a
DTensor, `held` gives the global indices its local tensor holds: dim 0 the experts this rank holds
(expert parallelism holds a subset), the concat dim where each source lies; for a plain tensor every
expert is held and each source's block is as wide as its shard tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from reshard.errors import PlanError

Spec = dict[str, Any]
Held = tuple[tuple[int, ...] | None, ...]


@dataclass(frozen=True)
class ExpertPiece:
    """One shard tensor's place in a fused parameter: expert `expert`, source `source` of `sources`."""

    param: str
    expert: int
    source: int
    sources: int  # tensors concatenated per expert (2 for gate|up, 1 for down)
    concat_dim: int | None  # the per-expert dim they are concatenated along (None: stacked only)


@dataclass
class ExpertLayout:
    """Every shard name, either renamed to a model tensor name or an ExpertPiece of a fused parameter."""

    renamed: dict[str, str] = field(default_factory=dict)
    pieces: dict[str, ExpertPiece] = field(default_factory=dict)

    def model_specs(self, specs: dict[str, Spec]) -> dict[str, Spec]:
        """The specs keyed by model names (for the module swaps), fused pieces left out."""
        return {self.renamed[n]: s for n, s in specs.items() if n in self.renamed}


@dataclass(frozen=True)
class ExpertView:
    """Where one per-expert shard tensor goes: `view` of the fused `param`'s local tensor (which holds
    `experts` experts), with `held` the global indices per dim of the per-expert tensor (None: not known)."""

    param: str
    source: int
    sources: int
    expert: int
    experts: int
    view: torch.Tensor
    held: Held


def shard_layout(model: nn.Module, names: Sequence[str]) -> ExpertLayout:
    """Where each shard tensor goes in `model`: its own tensors keep their names, others are renamed by
    transformers' renamings (unknown names pass through, for the caller to report), and per-expert
    tensors that a converter fuses become Pieces. A converter this cannot map back is a PlanError."""
    own = set(model.state_dict(keep_vars=True)) | {n for n, _ in model.named_parameters()}
    if own.issuperset(names):  # nothing to rename: transformers' mapping (~900 regexes, 0.3 s) is not needed
        return ExpertLayout(renamed={n: n for n in names})
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_renamings,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    layout = ExpertLayout()
    for name in names:
        if name in own:
            layout.renamed[name] = name
            continue
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            layout.renamed[name] = target
            continue
        conv = next(c for c in converters if pattern in c.source_patterns)
        concat_dim = _concat_dim(name, conv)
        m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), apply_renamings(name, renamings))
        if m is None or m.re.groups != 1:
            raise PlanError(f"{name}: matched transformers' pattern {pattern!r} but no expert index was found")
        layout.pieces[name] = ExpertPiece(target, int(m.group(1)), conv.source_patterns.index(pattern),
                                    len(conv.source_patterns), concat_dim)
    return layout


def _concat_dim(name: str, converter: Any) -> int | None:
    """The per-expert concatenation dim of a converter that can be mapped back (None: stacked only)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0:
        if len(ops) == 1 and len(converter.source_patterns) == 1:
            return None
        if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
            return ops[1].dim - 1
    raise PlanError(f"{name}: transformers' conversion {converter.source_patterns} -> {converter.target_patterns} "
                    f"uses {[type(o).__name__ for o in ops]}; reshard maps shard tensors back only through "
                    "MergeModulelist(dim=0) [+ Concatenate], i.e. per-expert tensors onto fused parameters")


def expert_views(
    params: Mapping[str, torch.Tensor], pieces: Mapping[str, ExpertPiece], shard_shapes: Mapping[str, Sequence[int]], *,
    local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, held: Callable[[torch.Tensor], Held] | None = None,
    global_shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, ExpertView]:
    """For each ExpertPiece (shard name -> its place) whose fused parameter is in `params`, the view of that
    parameter's local tensor its bytes belong in.

    `shard_shapes` are the shard tensors' (local) shapes; `local(p)` is a parameter's local tensor (a
    DTensor's `to_local()`); `held(p)` the global indices it holds per dim (None per dim where not
    known); `global_shapes` the per-expert tensors' global shapes (needed with `held`). A piece whose
    expert the local tensor does not hold is left out (the caller reports it as unexpected)."""
    groups: dict[str, dict[int, dict[int, str]]] = {}  # param -> source -> expert -> shard name
    for name, piece in pieces.items():
        if piece.param in params:
            groups.setdefault(piece.param, {}).setdefault(piece.source, {})[piece.expert] = name
    out: dict[str, ExpertView] = {}
    for pname, by_source in groups.items():
        first = pieces[_any(next(iter(by_source.values())))]
        t = local(params[pname])
        h = held(params[pname]) if held else (None,) * t.ndim
        experts = h[0] if h[0] is not None else tuple(range(t.shape[0]))
        position = {e: i for i, e in enumerate(experts)}
        dim = first.concat_dim
        for k, names in sorted(by_source.items()):
            sub_held, span = list(h[1:]), None  # the same for every expert of source k
            if dim is not None:
                start, length, base = _source_span(k, dim, by_source, shard_shapes, h[dim + 1], global_shapes)
                span = (start, length)
                if h[dim + 1] is not None:
                    sub_held[dim] = tuple(g - base for g in h[dim + 1][start:start + length])
            for e, name in names.items():
                if e not in position:
                    continue
                block = t[position[e]]
                if span is not None:
                    block = block.narrow(dim, *span)
                out[name] = ExpertView(pname, k, first.sources, e, len(experts), block, tuple(sub_held))
    return out


def uncovered(state: Mapping[str, torch.Tensor], layout: ExpertLayout, views: Mapping[str, ExpertView],
              names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the model tensors of `state` that no shard tensor fills, a tied alias counting as filled with
    its twin; the shard `names` that fill nothing): both empty when shard and model agree."""
    placed = {n for n, m in layout.renamed.items() if m in state}
    filled = {id(state[layout.renamed[n]]) for n in placed} | {id(state[v.param]) for v in views.values()}
    missing = sorted(n for n, t in state.items() if id(t) not in filled)
    return missing, sorted(set(names) - placed - views.keys())


def partly_covered(views: Mapping[str, ExpertView]) -> list[str]:
    """One line per fused parameter that the views cover only in part (every held expert's every source)."""
    seen: dict[str, set[tuple[int, int]]] = {}
    for v in views.values():
        seen.setdefault(v.param, set()).add((v.source, v.expert))
    out = []
    for param, got in seen.items():
        v = next(v for v in views.values() if v.param == param)
        if len(got) != v.sources * v.experts:
            out.append(f"{param} (the shard has {len(got)} of its {v.sources} x {v.experts} per-expert tensors)")
    return out


def _any(names: Mapping[int, str]) -> str:
    return next(iter(names.values()))


def _source_span(k: int, dim: int, by_source: Mapping[int, Mapping[int, str]],
                 shard_shapes: Mapping[str, Sequence[int]], held: tuple[int, ...] | None,
                 global_shapes: Mapping[str, Sequence[int]] | None) -> tuple[int, int, int]:
    """(start, length, global base) of source k on the concat dim of one expert's local block."""
    sizes = global_shapes if held is not None and global_shapes is not None else shard_shapes
    base = sum(int(sizes[_any(by_source[j])][dim]) for j in range(k) if j in by_source)
    if held is not None and global_shapes is not None:
        # where this rank's global indices of source k's range lie in its local tensor
        top = base + int(global_shapes[_any(by_source[k])][dim])
        positions = [i for i, g in enumerate(held) if base <= g < top]
        return (positions[0] if positions else 0), len(positions), base
    return base, int(shard_shapes[_any(by_source[k])][dim]), base


__all__ = ["ExpertView", "ExpertLayout", "ExpertPiece", "expert_views", "partly_covered", "shard_layout"]

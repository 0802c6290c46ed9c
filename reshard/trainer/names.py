"""Shard tensor names (the names on disk) <-> the model's tensors, by transformers' conversion mapping.

transformers 5 renames some checkpoint keys on load (Mixtral's `block_sparse_moe.` -> `mlp.`, GPT-NeoX's
`embed_out` -> `lm_head`) and fuses others: a layer's per-expert tensors become one 3-D parameter
(`mlp.experts.gate_up_proj` [E, 2I, H] from every `mlp.experts.N.gate_proj/up_proj.weight`,
MergeModulelist over experts then Concatenate). Shards keep the names on disk, so the trainer reads
the model's own mapping (`get_model_conversion_mapping`, `rename_source_key`) and places each shard
tensor in the model:

    renamed            the parameter or buffer of that (renamed) name
    fused (a Piece)    fused[e].narrow(dim, offset of source i, rows of source i)   (+ Concatenate)
                       fused[e]                                                   (MergeModulelist alone)

Views of a fused parameter are contiguous blocks, so the fill writes shard bytes straight into them,
and `save_rank_shard` reads them back under the names on disk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from reshard.errors import PlanError
from reshard.loaders import selection_shape

Spec = dict[str, Any]


@dataclass(frozen=True)
class Piece:
    """One shard tensor's place in a fused parameter: expert `expert`, source `source` of `sources`."""

    param: str
    expert: int
    source: int
    sources: int  # tensors concatenated per expert (2 for gate|up, 1 for down)
    concat_dim: int | None  # the per-expert dim they are concatenated along (None: stacked only)


@dataclass
class Layout:
    """Every shard name, either renamed to a model tensor name or a Piece of a fused parameter."""

    renamed: dict[str, str] = field(default_factory=dict)
    pieces: dict[str, Piece] = field(default_factory=dict)

    def model_specs(self, specs: dict[str, Spec]) -> dict[str, Spec]:
        """The specs keyed by model names (for the module swaps), fused pieces left out."""
        return {self.renamed[n]: s for n, s in specs.items() if n in self.renamed}


def _concat_dim(converter: Any) -> int | None:
    """The per-expert concatenation dim of a converter the trainer can map back (None: stack only)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0:
        if len(ops) == 1:
            return None
        if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
            return ops[1].dim - 1
    raise PlanError(f"transformers conversion {converter.source_patterns} -> {converter.target_patterns} uses "
                    f"{[type(o).__name__ for o in ops]}; the trainer maps back only MergeModulelist(dim=0) "
                    "[+ Concatenate]")


def shard_layout(model: nn.Module, names: list[str]) -> Layout:
    """Where each shard tensor goes in `model` (names the model has under a new name are renamed)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_renamings,
        rename_source_key,
    )

    own = set(model.state_dict(keep_vars=True)) | {n for n, _ in model.named_parameters()}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    layout = Layout()
    for name in names:
        if name in own:
            layout.renamed[name] = name
            continue
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            layout.renamed[name] = target  # unknown names surface in `shard_targets`
            continue
        conv = next(c for c in converters if pattern in c.source_patterns)
        m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), apply_renamings(name, renamings))
        if m is None:
            raise PlanError(f"{name}: matched transformers' pattern {pattern!r} but no expert index was found")
        layout.pieces[name] = Piece(target, int(m.group(1)), conv.source_patterns.index(pattern),
                                    len(conv.source_patterns), _concat_dim(conv))
    return layout


def piece_view(param: torch.Tensor, piece: Piece, rows: list[int]) -> torch.Tensor:
    """The view of `param` one shard tensor fills; `rows`: local sizes of the converter's sources."""
    block = param[piece.expert]
    if piece.concat_dim is None:
        return block
    return block.narrow(piece.concat_dim, sum(rows[: piece.source]), rows[piece.source])


def shard_targets(model: nn.Module, specs: dict[str, Spec]) -> dict[str, torch.Tensor]:
    """Shard tensor name -> the model tensor (or fused-parameter view) it fills and is saved from.

    Every parameter and persistent buffer of the model must be covered exactly by the shard.
    """
    layout = shard_layout(model, list(specs))
    own = {**dict(model.named_parameters()), **model.state_dict(keep_vars=True)}
    targets = {n: own[m] for n, m in layout.renamed.items() if m in own}
    rows: dict[tuple[str, int], int] = {}
    for name, piece in layout.pieces.items():
        if piece.concat_dim is not None:
            rows[piece.param, piece.source] = selection_shape(specs[name]["select"])[piece.concat_dim]
    for name, piece in layout.pieces.items():
        if piece.param in own:
            sizes = [rows.get((piece.param, i), 0) for i in range(piece.sources)]
            targets[name] = piece_view(own[piece.param], piece, sizes)
    covered: dict[str, set[tuple[int, int]]] = {}
    for piece in layout.pieces.values():
        covered.setdefault(piece.param, set()).add((piece.expert, piece.source))
    for param, got in covered.items():
        need = own[param].shape[0] * next(p.sources for p in layout.pieces.values() if p.param == param)
        if len(got) != need:
            raise PlanError(f"{param}: the shard holds {len(got)} of its {need} per-expert tensors")
    filled = {id(own[layout.renamed[n]]) for n in targets if n in layout.renamed}
    filled |= {id(own[p.param]) for p in layout.pieces.values() if p.param in own}
    missing = sorted(n for n, t in own.items() if id(t) not in filled)
    unknown = sorted(set(specs) - set(targets))
    if missing or unknown:
        raise PlanError(f"shard and model disagree: the model's {missing[:3]} are not in the shard, "
                        f"the shard's {unknown[:3]} are not in the model ({type(model).__name__})")
    return targets


__all__ = ["Layout", "Piece", "piece_view", "shard_layout", "shard_targets"]

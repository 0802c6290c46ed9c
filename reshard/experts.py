"""Per-expert checkpoint tensors -> views into a model's fused expert parameters.

transformers 5 fuses a MoE layer's per-expert checkpoint tensors into one parameter per projection:
`mlp.experts.E.gate_proj.weight` and `...up_proj.weight` (E = 0..n-1) become
`mlp.experts.gate_up_proj` of shape (n, gate+up, hidden), and `...down_proj.weight` becomes
`mlp.experts.down_proj` (n, hidden, inter). Its own conversion mapping says so
(`transformers.conversion_mapping`: a `WeightConverter` whose operations are `MergeModulelist(dim=0)`,
then optionally `Concatenate(dim=d)`). This module reads those converters and, for each per-expert
tensor a shard holds, returns where its bytes belong: a view into the (local part of the) fused
parameter, so a rank shard's bytes can land straight in it.

    rules = fused_rules(model)                       # from transformers' mapping for the model
    views = expert_views(params, shard_shapes, rules)
    views["model.layers.0.mlp.experts.3.up_proj.weight"].view   # a view of gate_up_proj's local tensor

Where the fused parameter is a DTensor, `held[0]` lists the experts this rank holds (expert
parallelism holds a subset) and the concat dim's global indices tell where each source lies; for a
plain tensor every expert is held and each source's block is as wide as its shard tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class FusedRule:
    """Per-expert tensors matching `sources` (each with one `*` for the expert index) are stacked on
    dim 0 of `target`; with several sources, their stacks are concatenated on `concat_dim`."""

    sources: tuple[str, ...]
    target: str
    concat_dim: int | None = None

    def match(self, name: str) -> tuple[str, int, int] | None:
        """(fused parameter name, source index, expert index) for a per-expert tensor name."""
        for k, pattern in enumerate(self.sources):
            before, _, after = pattern.partition("*")
            m = re.fullmatch(rf"(.*?){re.escape(before)}(\d+){re.escape(after)}", name)
            if m:
                return f"{m.group(1)}{self.target}", k, int(m.group(2))
        return None


@dataclass(frozen=True)
class ExpertView:
    """Where one per-expert shard tensor goes: `view` of the fused `param`'s local tensor, which
    holds `held` (global indices per dim of the per-expert tensor, None where not known)."""

    param: str
    source: int
    sources: int
    expert: int
    view: torch.Tensor
    held: tuple[tuple[int, ...] | None, ...]


def checkpoint_renamer(model: Any) -> Callable[[str], str]:
    """Checkpoint key -> model key by the renamings of transformers' conversion mapping for `model`
    (e.g. Mixtral's `block_sparse_moe.` -> `mlp.`), applied in order; the identity without transformers."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return lambda name: name
    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]

    def rename(name: str) -> str:
        for r in renamings:
            name = r.rename_source_key(name)[0]
        return name

    return rename


def fused_rules(model: Any) -> list[FusedRule]:
    """The fusing converters of transformers' conversion mapping for `model` (none without transformers)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:
        return []
    rules = []
    for conv in get_model_conversion_mapping(model, add_legacy=False):
        ops = list(getattr(conv, "operations", []))
        if not isinstance(conv, WeightConverter) or len(conv._original_target_patterns) != 1 or not ops:
            continue
        if not (isinstance(ops[0], MergeModulelist) and ops[0].dim == 0):
            continue
        concat = None
        if len(ops) == 2 and isinstance(ops[1], Concatenate):
            concat = ops[1].dim
        elif len(ops) != 1:
            continue
        sources = tuple(conv._original_source_patterns)
        if all(s.count("*") == 1 for s in sources) and (concat is not None or len(sources) == 1):
            rules.append(FusedRule(sources, conv._original_target_patterns[0], concat))
    return rules


HeldFn = Callable[[torch.Tensor], tuple[tuple[int, ...] | None, ...]]


def expert_views(
    params: Mapping[str, torch.Tensor], shard_shapes: Mapping[str, Sequence[int]], rules: Sequence[FusedRule], *,
    local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, held: HeldFn | None = None,
    global_shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, ExpertView]:
    """For each shard tensor name that a rule maps onto a parameter of `params` (and that is not a
    parameter itself), the view of that parameter's local tensor its bytes belong in.

    `shard_shapes` are the shard's (local) tensor shapes; `local(p)` is a parameter's local tensor
    (a DTensor's `to_local()`); `held(p)` the global indices it holds per dim (None per dim where not
    known); `global_shapes` the per-expert tensors' global shapes (needed with `held`). A tensor
    whose expert this rank does not hold is left out (the caller reports it as unexpected)."""
    groups: dict[str, tuple[FusedRule, dict[int, dict[int, str]]]] = {}
    for name in shard_shapes:
        if name in params:
            continue
        for rule in rules:
            hit = rule.match(name)
            if hit and hit[0] in params:
                groups.setdefault(hit[0], (rule, {}))[1].setdefault(hit[1], {})[hit[2]] = name
                break
    out: dict[str, ExpertView] = {}
    for pname, (rule, by_source) in groups.items():
        t = local(params[pname])
        h = held(params[pname]) if held else (None,) * t.ndim
        experts = h[0] if h[0] is not None else tuple(range(t.shape[0]))
        cdim = None if rule.concat_dim is None or len(rule.sources) == 1 else rule.concat_dim % t.ndim
        position = {e: i for i, e in enumerate(experts)}
        for k, names in sorted(by_source.items()):
            sub_held, span = list(h[1:]), None  # the same for every expert of source k
            if cdim is not None:
                start, length, base = _source_span(k, cdim - 1, by_source, shard_shapes, h[cdim], global_shapes)
                span = (start, length)
                if h[cdim] is not None:
                    sub_held[cdim - 1] = tuple(g - base for g in h[cdim][start:start + length])
            for e, name in names.items():
                if e not in position:
                    continue
                block = t[position[e]]
                if span is not None:
                    block = block.narrow(cdim - 1, *span)
                out[name] = ExpertView(pname, k, len(rule.sources), e, block, tuple(sub_held))
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

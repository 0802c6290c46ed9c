"""A model's tensor names -> where their values are stored in a checkpoint, and a block of each as boxes.

A destination describes what it holds in its own names (a state dict's keys, torch DCP's read items);
the checkpoint stores them under the names on disk. transformers renames some on load and fuses MoE
experts (`reshard.fill.experts.shard_layout` reads the model's own conversion mapping), so each model
name is stored as

    Whole("model.layers.0.block_sparse_moe.gate.weight")      # one tensor, maybe renamed (Mixtral's mlp.gate)
    Fused(...)    # [E, gate+up, H] from every expert's gate_proj and up_proj: E x 2 tensors on disk

`stored_names(listing, model=..., config=...)` maps every name of the model (its state dict: parameters,
persistent buffers, a tied head under both names) and every name on disk, each to what holds it;
`boxes_of(stored, offsets, sizes)` turns a block of a model tensor into boxes of tensors on disk and
where each lands in the block (a fused block is a box per expert and per source it covers).
Without a model, `model_for(config)` builds transformers' own on the meta device (no memory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from reshard.errors import PlanError
from reshard.fill.experts import ExpertPiece, shard_layout
from reshard.format.box_request import Box

Listing = Mapping[str, tuple[str, tuple[int, ...]]]  # name on disk -> (dtype, shape)


@dataclass(frozen=True)
class Whole:
    """A model tensor stored as tensor `name` on disk, the same shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Fused:
    """A model tensor [E, ...] made of per-expert tensors on disk: `names[e][k]` is expert e's source k,
    concatenated along per-expert dim `dim` (None: one source, stacked only) at `starts[k]`."""

    dtype: str
    shape: tuple[int, ...]
    names: tuple[tuple[str, ...], ...]
    dim: int | None
    starts: tuple[int, ...]
    lengths: tuple[int, ...]


Stored = Whole | Fused
Landing = tuple[Box, tuple[int, ...], tuple[int, ...]]  # a box on disk, and where in the block it lands


def boxes_of(stored: Stored, offsets: Sequence[int], sizes: Sequence[int]) -> list[Landing]:
    """The boxes on disk that make block (offsets, sizes) of a model tensor, each with the offsets and
    sizes within the block its values land at (a whole tensor's block is one box landing on all of it)."""
    offsets, sizes = tuple(offsets), tuple(sizes)
    if isinstance(stored, Whole):
        return [(Box(stored.name, offsets, sizes), (0,) * len(sizes), sizes)]
    out: list[Landing] = []
    rest_o, rest_s = offsets[1:], sizes[1:]
    for e in range(offsets[0], offsets[0] + sizes[0]):
        for k, name in enumerate(stored.names[e]):
            if stored.dim is None:
                out.append((Box(name, rest_o, rest_s), (e - offsets[0], *(0,) * len(rest_s)), (1, *rest_s)))
                continue
            d, start, length = stored.dim, stored.starts[k], stored.lengths[k]
            lo, hi = max(rest_o[d], start), min(rest_o[d] + rest_s[d], start + length)
            if lo >= hi:
                continue
            box_o = rest_o[:d] + (lo - start,) + rest_o[d + 1 :]
            box_s = rest_s[:d] + (hi - lo,) + rest_s[d + 1 :]
            at = (e - offsets[0], *(0,) * d, lo - rest_o[d], *(0,) * (len(rest_s) - d - 1))
            out.append((Box(name, box_o, box_s), at, (1, *box_s)))
    return out


def stored_names(listing: Listing, *, model: nn.Module | None = None) -> dict[str, Stored]:
    """Every name on disk as itself, and (with `model`) every tensor name of the model as what holds it
    (the module docstring); `PlanError` where the model fuses tensors in a way that cannot be read back."""
    out: dict[str, Stored] = {n: Whole(n, dtype, tuple(shape)) for n, (dtype, shape) in listing.items()}
    if model is None:
        return out
    layout = shard_layout(model, list(listing))
    state = model.state_dict(keep_vars=True)
    for disk, own in layout.renamed.items():
        if own in state:
            out.setdefault(own, out[disk])
    by_param: dict[str, dict[str, ExpertPiece]] = {}
    for disk, piece in layout.pieces.items():
        by_param.setdefault(piece.param, {})[disk] = piece
    for param, pieces in by_param.items():
        out[param] = _fused(param, pieces, listing, tuple(state[param].shape) if param in state else None)
    holders = {id(t): n for n, t in state.items() if n in out}
    for n, t in state.items():  # a tied head: the embedding's tensor under a second name
        if n not in out and id(t) in holders:
            out[n] = out[holders[id(t)]]
    return out


def _fused(param: str, pieces: Mapping[str, ExpertPiece], listing: Listing, shape: tuple[int, ...] | None) -> Fused:
    first = next(iter(pieces.values()))
    experts = 1 + max(p.expert for p in pieces.values())
    names = [[""] * first.sources for _ in range(experts)]
    for disk, p in pieces.items():
        names[p.expert][p.source] = disk
    missing = [(e, k) for e in range(experts) for k in range(first.sources) if not names[e][k]]
    shapes = [listing[names[0][k]][1] for k in range(first.sources)] if not missing else []
    if missing:
        raise PlanError(f"{param}: the checkpoint lacks expert {missing[0][0]}'s source {missing[0][1]} of the "
                        f"{experts} x {first.sources} per-expert tensors transformers fuses into it")
    dtypes = {listing[n][0] for row in names for n in row}
    if len(dtypes) != 1 or any(listing[names[e][k]][1] != shapes[k] for e in range(experts) for k in range(len(shapes))):
        raise PlanError(f"{param}: its per-expert tensors on disk differ in dtype or shape ({sorted(dtypes)}); "
                        "they cannot be read as one fused tensor")
    dim = first.concat_dim
    lengths = tuple(s[dim] for s in shapes) if dim is not None else (shapes[0][0],)
    per = list(shapes[0])
    if dim is not None:
        per[dim] = sum(lengths)
    fused = (experts, *per)
    if shape is not None and shape != fused:
        raise PlanError(f"{param}: the model's tensor has shape {list(shape)}, its {experts} x {len(shapes)} "
                        f"per-expert tensors on disk make {list(fused)}: a checkpoint of another config, or a "
                        "conversion of transformers' that reshard cannot read back; nothing was filled")
    starts = tuple(sum(lengths[:k]) for k in range(len(lengths)))
    return Fused(dtypes.pop(), fused, tuple(map(tuple, names)), dim, starts, lengths)


def model_for(config: dict[str, Any] | None) -> nn.Module | None:
    """transformers' causal-LM model of `config` (a config.json dict) on the meta device, for its names; None
    where there is no config or transformers does not know it (then the names on disk are all there is)."""
    if not config or not isinstance(config.get("model_type"), str):
        return None
    try:
        import torch

        from reshard.fill.empty_model import hf_config, meta_model

        return meta_model(hf_config(config), dtype=torch.float32)
    except Exception:  # noqa: BLE001  no transformers, an unknown or unbuildable architecture: names on disk only
        return None


__all__ = ["Fused", "Landing", "Listing", "Stored", "Whole", "boxes_of", "model_for", "stored_names"]

"""The quantized kinds: `column_fp8`, `row_fp8`, `packed_column_fp8`, `vocab_embed_fp8`, `replicate_fp8`.

Each is its base kind with an option `block` (the scale granularity of the trailing dims: an int is a
block of that many indices, null one scale for the whole dim). "The split is the same, only the
precision differs", plus two rules for the tensors that come with a weight:

- `X.weight` is split exactly as the base kind splits it, but every rank boundary must fall on a
  block edge; otherwise planning fails, naming the dim size, the block, tp and the tps that work.
- `X.weight_scale_inv` / `X.weight_scale` get the blocks of the rows and columns their rank's weight
  holds: the base kind's split of the weight, in block units (kv heads shared by several ranks take
  their blocks with them; a replicated weight keeps its full scale; a per-tensor scale is replicated).
- `X.input_scale` is replicated; anything else (a bias) is split as the base kind splits it.

On the trainer side each quantized kind uses its base kind's parallel layer. The kinds, their names
and the companions' suffixes are those of the scheme `reshard.rules.quant.scheme.FP8` names: this module
registers a loader and a layer for each of its `bases` (`register_scheme_kinds`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reshard.errors import ManifestError, PlanError, TpMismatchError
from reshard.format.selection import Interval, Selection, full_selection
from reshard.rules.kinds import (
    ReplicateLoader,
    ShardLoader,
    SliceLoader,
    known_kinds,
    layer_factory,
    loader_for,
    register_layer,
    register_loader,
)
from reshard.rules.quant.scheme import FP8, Block, QuantScheme, check_block, scheme_of_kind

if TYPE_CHECKING:
    from reshard.rules.manifest import Rule

MAX_LISTED_TP = 64


def granularity(ndim: int, block: Block) -> Block:
    """The block per dim of an `ndim`-dim weight: `block` covers the trailing dims, leading dims are per index."""
    return (1,) * max(0, ndim - len(block)) + tuple(block[-ndim:] if ndim else ())


def merged(intervals: Sequence[Interval]) -> list[Interval]:
    """Adjacent intervals joined: a rank's q|k|v pieces of a fused tensor that touch share their blocks."""
    out: list[Interval] = []
    for a, b in intervals:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def off_edge(intervals: Sequence[Interval], size: int, block: int) -> int | None:
    """The first boundary of `intervals` inside a block of `size` indices (the end of the dim is an edge)."""
    for a, b in merged(intervals):
        if a % block:
            return a
        if b % block and b != size:
            return b
        if b > size and size % block:  # padding after a partial block: its scale block would be split
            return size
    return None


class QuantizedWeightLoader(SliceLoader):
    """The base loader's split of a quantized weight, checked to cut only on block edges."""

    def __init__(self, base: ShardLoader, block: Block) -> None:
        self.base, self.block = base, block

    def _check(self, shape: tuple[int, ...], sel: Selection) -> tuple[int, int, int] | None:
        for d, b in enumerate(granularity(len(shape), self.block)):
            if b is not None and b > 1:
                bad = off_edge(sel[d], shape[d], b)
                if bad is not None:
                    return d, b, bad
        return None

    def _works(self, shape: tuple[int, ...], tp: int) -> bool:
        try:
            return all(self._check(shape, self.base.select(shape, r, tp)) is None for r in range(tp))
        except PlanError:
            return False

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        sel = self.base.select(shape, rank, world_size)
        bad = self._check(shape, sel)
        if bad is not None:
            d, b, at = bad
            good = [t for t in range(1, MAX_LISTED_TP + 1) if self._works(shape, t)]
            raise TpMismatchError(
                f"dim {d} has size {shape[d]} and tp={world_size} puts a rank boundary at {at}, inside a "
                f"scale block of {b} (block {list(self.block)}), which two ranks would share",
                f"pick tp in {{{','.join(map(str, good))}}}")
        return sel


class BlockScaleLoader(SliceLoader):
    """A weight's scale: the blocks of the rows and columns the base loader gives the rank's weight.

    The weight is split on a virtual shape of whole blocks (scale size x block): when the real weight
    splits on block edges (which `QuantizedWeightLoader` enforces) every split dim is whole blocks,
    so both agree; at tp=1 and for a single scale every rank gets all of it.
    """

    def __init__(self, base: ShardLoader, block: Block) -> None:
        self.base, self.block = base, block

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        if world_size == 1 or all(n == 1 for n in shape):
            return full_selection(shape)
        if len(shape) < len(self.block):
            raise PlanError(f"scale of shape {list(shape)} has fewer dims than its block {list(self.block)}")
        g = granularity(len(shape), self.block)
        for d, (n, b) in enumerate(zip(shape, g)):
            if b is None and n != 1:
                raise PlanError(f"scale has size {n} along dim {d}, where block {list(self.block)} has one scale")
        virtual = tuple(n * b if b else world_size for n, b in zip(shape, g))
        wsel = self.base.select(virtual, rank, world_size)
        out: list[tuple[Interval, ...]] = []
        for d, (n, b) in enumerate(zip(shape, g)):
            if b is None:
                out.append(((0, n),))
                continue
            if off_edge(wsel[d], virtual[d], b) is not None:
                raise PlanError(f"the weight's split along dim {d} does not fall on blocks of {b}")
            out.append(tuple((a // b, -(-e // b)) for a, e in merged(wsel[d])))
        return tuple(out)


class AsKind:
    """A rule seen as its base kind: what the base kind's factory reads (kind, pattern, options)."""

    __slots__ = ("kind", "pattern", "options")

    def __init__(self, kind: str, rule: Rule) -> None:
        self.kind, self.pattern, self.options = kind, rule.pattern, rule.options


def quantized_loader(rule: Rule, suffix: str, *, base: str, scheme: QuantScheme = FP8) -> ShardLoader:
    """The loader of kind `{base}_fp8` (`scheme.kind(base)`) for a tensor ending in `suffix` (see the module docstring)."""
    try:
        block = check_block(rule.options.get("block"), f"rule {rule.pattern!r} ({scheme.kind(base)})")
    except ManifestError as e:
        raise PlanError(str(e)) from None
    as_base: Any = AsKind(base, rule)
    if suffix == ".weight":
        return QuantizedWeightLoader(loader_for(as_base, ".weight"), block)
    if suffix in scheme.scale_suffixes:
        return BlockScaleLoader(loader_for(as_base, ".weight"), block)
    if suffix in scheme.replicated_suffixes:
        return ReplicateLoader()
    return loader_for(as_base, suffix)


def base_kind(kind: str) -> str:
    """`column` for `column_fp8`; a kind that is not quantized is its own base."""
    scheme = scheme_of_kind(kind)
    base = scheme.base_of(kind) if scheme is not None else None
    return kind if base is None else base


def quantized_kind(kind: str, scheme: QuantScheme = FP8) -> str:
    """The quantized variant of `kind` in `scheme`; an error naming the variants when it has none."""
    if scheme.base_of(kind) is not None:
        return kind
    variant = scheme.kind(kind)
    if variant not in known_kinds():
        have = [k for k in known_kinds() if scheme.base_of(k) is not None]
        raise ManifestError(
            f"kind {kind!r} has no quantized variant (have {', '.join(have)}); add "
            f"`@register_loader({variant!r})` returning `quantized_loader(rule, suffix, base={kind!r})`"
        )
    return variant


def base_layer(base: str) -> Any:
    def factory(module: Any, spec: dict[str, Any], group: Any) -> Any:
        make = layer_factory(base)
        return module if make is None else make(module, {**spec, "kind": base}, group)

    return factory


def register_scheme_kinds(scheme: QuantScheme) -> None:
    """For each of `scheme.bases`, its quantized kind: a loader (`quantized_loader`: same as one
    `@register_loader("column_fp8")` function per kind) and a layer (the base kind's)."""
    for base in scheme.bases:
        register_loader(scheme.kind(base))(functools.partial(quantized_loader, base=base, scheme=scheme))
        register_layer(scheme.kind(base))(base_layer(base))


register_scheme_kinds(FP8)

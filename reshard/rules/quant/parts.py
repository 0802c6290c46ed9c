"""The kinds of a packed format described by its parts (`QuantScheme.parts`): one loader for every part.

A quantized module `X` stores its logical weight (`[N, K]`, or `[E, N, K]` for fused experts) as
several tensors, each a `Part` whose stored dims (`Axis`) index the logical dims in some unit: NVFP4's
`X.weight` `[N, K/2]` holds K in units of 2, its `X.weight_scale` `[N, K/16]` in units of 16; MXFP4's
`X_blocks` `[E, N, K/32, 16]` holds K in blocks of 32 and a dim that is no logical one. The kind
`{base}{scheme.suffix}` (`expert_column_mxfp4`) splits every part where the base kind splits the
logical weight:

1. the part's stored shape gives a logical shape (each stored size times its unit; a logical dim the
   part does not hold is a placeholder, taken whole);
2. the base kind's loader selects on that logical shape;
3. each rank boundary must fall on an edge of the module's unit along that dim: the least common
   multiple of the units of every part of the scheme on it (and the rule's `unit` option, a list over
   the trailing logical dims, for a constraint no tensor shows: gpt-oss' gate/up rows come in pairs
   and the intermediate dim in blocks of 32, so `unit: [64, null]`). A boundary inside a unit is one
   error naming the dim, the unit and the tps that work, so every tensor of the module refuses the
   same splits (nothing is written: the plan fails first);
4. the logical intervals become stored ones (`a // unit`, `ceil(b / unit)`); a stored dim with no
   logical dim, or with one entry for the whole dim, is taken whole.

A part that is replicated (`axes=None`), or a scalar, goes to every rank; a tensor of a module that is
none of the scheme's parts (a `.bias` of a linear) is split as the base kind splits it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reshard.errors import ManifestError, PlanError
from reshard.format.selection import Interval, Selection, full_selection
from reshard.rules.kinds import (
    ReplicateLoader,
    ShardLoader,
    SliceLoader,
    loader_for,
    register_layer,
    register_loader,
)
from reshard.rules.quant.fp8_kinds import MAX_LISTED_TP, AsKind, base_layer, merged, off_edge
from reshard.rules.quant.scheme import Axis, Part, QuantScheme, Unit, register_scheme

if TYPE_CHECKING:
    from reshard.rules.manifest import Rule

LOGICAL = {-1: "input (K)", -2: "output (N)", -3: "expert"}


def _unit(unit: Unit, options: dict[str, Any], where: str) -> int | None:
    """An axis' unit, an option's value where it names one (an option set to null: one entry for the
    whole dim, as a per-channel scale or an act-order GPTQ's scales along K, which every rank keeps)."""
    if isinstance(unit, str):
        value = options.get(unit)
        if value is None and unit in options:
            return None
        if type(value) is not int or value <= 0:
            raise PlanError(f"{where}: option {unit}={value!r} must be a positive integer")
        return value
    return unit


def rule_units(options: dict[str, Any], where: str) -> dict[int, int]:
    """The rule option `unit`: a list over the trailing logical dims (ints or nulls) -> {dim from the end: unit}."""
    units = options.get("unit")
    if units is None:
        return {}
    if not isinstance(units, list | tuple) or not units or not all(u is None or (type(u) is int and u > 0)
                                                                       for u in units):
        raise PlanError(f"{where}: option `unit` must be a list of positive integers or nulls, got {units!r}")
    return {d - len(units): u for d, u in enumerate(units) if u is not None}


def module_units(scheme: QuantScheme, options: dict[str, Any], where: str) -> dict[int, tuple[int, str]]:
    """{logical dim: (the module's unit along it, what names it)}: the lcm of every part's unit on that
    dim and the rule's `unit` option."""
    out: dict[int, tuple[int, str]] = {}

    def add(dim: int, unit: int, what: str) -> None:
        have, name = out.get(dim, (1, ""))
        lcm = math.lcm(have, unit)
        out[dim] = (lcm, what if unit == lcm and unit > have else name)

    for part in scheme.parts:
        for axis in part.axes or ():
            unit = _unit(axis.unit, options, where)
            if axis.dim is not None and unit is not None and unit > 1:
                add(axis.dim, unit, axis.what or f"{part.suffix.lstrip('._')} unit of {unit}")
    for dim, unit in rule_units(options, where).items():
        add(dim, unit, f"unit of {unit} (rule option `unit`)")
    return out


def _aligned(axes: tuple[Axis, ...], ndim: int) -> tuple[Axis, ...]:
    """The axes of a stored tensor of `ndim` dims: `axes` right-aligned, leading dims index the logical
    dims before the first one, one to one."""
    extra = ndim - len(axes)
    if extra < 0:
        raise PlanError(f"a tensor of {ndim} dims, where its part has {len(axes)}")
    first = min((a.dim for a in axes if a.dim is not None), default=0)
    return tuple(Axis(first - extra + i) for i in range(extra)) + axes


class PartLoader(SliceLoader):
    """One part of a quantized module, split where `base` splits the module's logical weight (see the module)."""

    def __init__(self, base: ShardLoader, part: Part, scheme: QuantScheme, options: dict[str, Any], where: str) -> None:
        self.base, self.part, self.scheme = base, part, scheme
        self.units = module_units(scheme, options, where)
        self.resolve = functools.partial(_unit, options=options, where=where)

    def _logical(self, shape: tuple[int, ...], world_size: int) -> tuple[tuple[Axis, ...], tuple[int, ...], set[int]]:
        """(the stored dims' axes, the logical shape, the logical dims this part holds, from the end)."""
        assert self.part.axes is not None
        axes = _aligned(self.part.axes, len(shape))
        held = {a.dim: n * u for a, n in zip(axes, shape)
                if a.dim is not None and (u := self.resolve(a.unit)) is not None}
        ndim = max([2, *(-d for d in held)])
        return axes, tuple(held.get(d - ndim, world_size) for d in range(ndim)), set(held)

    def _edges(self, logical: tuple[int, ...], sel: Selection, held: set[int]) -> tuple[int, int, str, int] | None:
        """(logical dim, unit, what, boundary) of the first rank boundary inside a unit, else None."""
        ndim = len(logical)
        for dim in sorted(held):
            unit, what = self.units.get(dim, (1, ""))
            if unit > 1:
                bad = off_edge(sel[dim + ndim], logical[dim + ndim], unit)
                if bad is not None:
                    return dim, unit, what, bad
        return None

    def _select_logical(self, logical: tuple[int, ...], held: set[int], rank: int, world_size: int) -> Selection:
        try:
            return self.base.select(logical, rank, world_size)
        except PlanError:
            if len(held) == len(logical):
                raise
            # the base kind splits a logical dim this part does not hold (its placeholder size broke the
            # kind's options): the part is whole along the dims it holds; the weight, which holds them all,
            # reports any real error
            return full_selection(logical)

    def _works(self, shape: tuple[int, ...], tp: int) -> bool:
        """Whether `tp` splits this part on its units; a split the base kind refuses does not work (no
        fallback to a whole part here: the tps an error lists must work for every part of the module)."""
        try:
            _axes, logical, held = self._logical(shape, tp)
            return all(self._edges(logical, self.base.select(logical, r, tp), held) is None for r in range(tp))
        except PlanError:
            return False

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        if self.part.axes is None or world_size == 1 or (
                self.part.suffix != self.scheme.weight_suffix and all(n == 1 for n in shape)):
            return full_selection(shape)
        axes, logical, held = self._logical(shape, world_size)
        sel = self._select_logical(logical, held, rank, world_size)
        bad = self._edges(logical, sel, held)
        if bad is not None:
            dim, unit, what, at = bad
            good = [t for t in range(1, MAX_LISTED_TP + 1) if self._works(shape, t)]
            raise PlanError(
                f"the {LOGICAL.get(dim, f'{dim}')} dim has {logical[dim + len(logical)]} values and tp={world_size} "
                f"puts a rank boundary at {at}, inside one {what} ({unit} values), which two "
                f"ranks would share; pick tp in {{{','.join(map(str, good))}}}"
            )
        ndim = len(logical)
        out: list[tuple[Interval, ...]] = []
        for axis, n in zip(axes, shape):
            unit = self.resolve(axis.unit)
            if axis.dim is None or unit is None:
                out.append(((0, n),))
            else:
                out.append(tuple((a // unit, -(-b // unit)) for a, b in merged(sel[axis.dim + ndim])))
        return tuple(out)


def part_loader(rule: Rule, suffix: str, *, base: str, scheme: QuantScheme) -> ShardLoader:
    """The loader of kind `scheme.kind(base)` for a tensor whose name ends in `suffix` (see the module)."""
    part = scheme.part(suffix)
    as_base: Any = AsKind(base, rule)
    if part is None:
        return loader_for(as_base, suffix)
    if part.axes is None:
        return ReplicateLoader()
    where = f"rule {rule.pattern!r} ({scheme.kind(base)})"
    try:
        module_units(scheme, rule.options, where)  # an option a unit names, checked when the rule is first used
    except ManifestError as e:
        raise PlanError(str(e)) from None
    return PartLoader(loader_for(as_base, ".weight"), part, scheme, dict(rule.options), where)


def register_part_kinds(scheme: QuantScheme) -> QuantScheme:
    """Register the packed format `scheme` (`register_scheme`) and, for each of its `bases`, its quantized
    kind: a loader (`part_loader`) and a layer (the base kind's). Registering a name twice is an error."""
    if not scheme.parts:
        raise ManifestError(f"quantization scheme {scheme.name!r} has no parts; FP8-style schemes use "
                            "reshard.rules.quant.fp8_kinds.register_scheme_kinds")
    register_scheme(scheme)
    for base in scheme.bases:
        register_loader(scheme.kind(base))(functools.partial(part_loader, base=base, scheme=scheme))
        register_layer(scheme.kind(base))(base_layer(base))
    return scheme


def stored_units(scheme: QuantScheme, suffix: str, ndim: int, options: dict[str, Any]) -> Sequence[tuple[int | None, int | None]]:
    """Per stored dim of part `suffix` (`ndim` dims): (logical dim from the end or None, unit or None):
    what a dequantizer or a test needs to map stored indices to logical ones."""
    part = scheme.part(suffix)
    if part is None or part.axes is None:
        return [(None, None)] * ndim
    return [(a.dim, _unit(a.unit, options, scheme.name)) for a in _aligned(part.axes, ndim)]

"""Fast rank planning for checkpoints of many tensors that share shape, dtype and rule (MoE experts).

`RankPlanner(tensors, files, rules, tp).plan(rank)` returns exactly what planning each tensor on its
own gives (`reshard.plan.segments.segments_for`, `OutTensor.describe`, `layout`), byte for byte, but does the
work once per *layout group*: tensors stored whole in one file, with the same rule (and name
suffix), shape and dtype get the same selection, the same output shape and description, and the same
source byte runs shifted by where the tensor starts in its file. Per tensor and rank what is left is
building its `OutTensor` and `Segment`s and its header entry.

The header is assembled from per-group JSON fragments instead of `json.dumps` of the whole dict; the
fragments are made by `json.dumps` with the same options, so the bytes are the same (a test compares
with the per-tensor planner's output on a large synthetic checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from operator import attrgetter
from typing import Any

from reshard.errors import PlanError, TpMismatchError
from reshard.format.checkpoint import DTYPE_SIZES, GlobalTensor, Source, whole_infos
from reshard.format.rank_file import (
    FORMAT,
    HEADER_REVISION,
    HeaderEncoder,
    dcp_fragment,
    header_prefix,
    plan_identity,
    rule_json,
    tensor_json,
)
from reshard.format.selection import full_selection, selection_shape
from reshard.gcpause import paused_gc
from reshard.layout.mesh import MAX_WORLD, Layout
from reshard.layout.placement import Placement
from reshard.layout.roles import source_roles
from reshard.plan.advice import advised
from reshard.plan.planned import GroupLayout, LazySequence, PlannedTensors, TensorGroups
from reshard.plan.reads import bytes_read
from reshard.plan.segments import segments_for
from reshard.plan.types import OutTensor, Plan, RankPlan, data_order, source_files
from reshard.rules.manifest import Manifest, Rule

__all__ = ["LayoutPlanner", "LazyRanks", "RankPlanner", "make_plan", "make_planner", "resolve_rules"]

class RankPlanner:
    """Plans the ranks that hold one set of tensors (`placement` says which part each gets): tensors are
    sorted into layout groups once; each rank then computes one layout per group and, per tensor, its
    offsets and header entry with list comprehensions."""

    def __init__(self, tensors: Mapping[str, GlobalTensor], files: dict[str, tuple[int, int | str]],
                 rules: Mapping[str, Rule], placement: Placement, *, manifest_source: str = "rules",
                 plan_id: str | None = None) -> None:
        self.tensors, self.files, self.rules, self.placement = tensors, files, rules, placement
        self.plan_id = plan_id  # the identity each header records (`LayoutPlanner.plan_id`); None: none
        self.manifest_source = manifest_source  # for the advice when a tp does not fit (`reshard.plan.advice`)
        keys, meta, loc = _group_keys(tensors, rules)
        gid_of = {key: gid for gid, key in enumerate(dict.fromkeys(keys))}  # numbered in source order
        src = list(tensors)
        src_gids = list(map(gid_of.__getitem__, keys))
        del keys
        first_of = dict(zip(reversed(src_gids), reversed(src)))
        self.firsts: list[str] = [first_of[gid] for gid in range(len(gid_of))]  # the first tensor (in source order) of each group
        names = sorted(src)  # the metadata's key order (json sort_keys)
        # each tensor's group number in name order (a Checkpoint's tensors are in name order already)
        self.sorted_gids = src_gids if names == src else list(map(dict(zip(src, src_gids)).__getitem__, names))
        ordered = _file_order(names, meta)
        if ordered is names and names == src:  # the same as the else branch, without the lookups
            order, where, gids = list(meta.items()), _places(loc.values()), self.sorted_gids
        else:
            order = list(zip(ordered, map(meta.__getitem__, ordered)))
            where = _places(map(loc.__getitem__, ordered))
            gids = self.sorted_gids if ordered is names else list(map(dict(zip(names, self.sorted_gids)).__getitem__, ordered))
        self.groups = TensorGroups(order, where, gids, rules)
        self.encoder = HeaderEncoder(names, ordered)
        self._layouts: dict[int, list[GroupLayout]] = {}
        self._entries: tuple[Any, array[int], str] | None = None  # the last rank's header entries

    def layouts(self, rank: int) -> list[GroupLayout]:
        """Each group's layout on `rank` (all a bad rule or shape can fail on), made once per rank."""
        hit = self._layouts.get(rank)
        if hit is None:
            self.placement.layout.check_rank(rank)
            # in source order, so the first bad tensor is the one an error names
            try:
                hit = self._layouts[rank] = [self._layout(name, self.tensors[name], rank) for name in self.firsts]
            except TpMismatchError as e:  # named with the tp values that fit every tensor, not this one alone
                raise advised(e, self.tensors, self.rules, manifest_source=self.manifest_source) from None
        return hit

    def forget(self, rank: int) -> None:
        """Drop the layouts kept for a second `plan(rank)` (a RankPlan holds its own)."""
        self._layouts.pop(rank, None)

    def plan(self, rank: int) -> RankPlan:
        layouts = self.layouts(rank)
        ends, entries = self._offsets(layouts)
        # per tensor in name order, its group's description escaped as part of the "tensors" JSON string
        described = [HeaderEncoder.escape(g.describe) for g in layouts]
        placed = [HeaderEncoder.escape(g.placed) for g in layouts]
        place = dataclasses.replace(self.placement.place(rank), plan=self.plan_id)
        header = self.encoder.header(header_prefix(place),
                                     list(map(described.__getitem__, self.sorted_gids)), entries,
                                     list(map(placed.__getitem__, self.sorted_gids)))
        return RankPlan(rank, self.placement.layout.world, PlannedTensors(self.groups, layouts, ends), header, self.files)

    def _offsets(self, layouts: list[GroupLayout]) -> tuple[array[int], str]:
        """Each tensor's end offset and the header's tensor entries; the last rank's again when its
        groups' sizes and entries are the same (even splits: only selections differ between ranks)."""
        sizes, heads = [g.nbytes for g in layouts], [g.entry for g in layouts]
        if self._entries is not None and self._entries[0] == (sizes, heads):
            return self._entries[1], self._entries[2]
        gids = self.groups.gids
        ends = array("q", accumulate(map(sizes.__getitem__, gids)))
        stops = list(map(str, ends))  # a tensor begins where the one before it ends
        entries = self.encoder.entries(list(map(heads.__getitem__, gids)), ["0", *stops[:-1]][: len(stops)], stops)
        self._entries = ((sizes, heads), ends, entries)
        return ends, entries

    def _layout(self, name: str, gt: GlobalTensor, rank: int) -> GroupLayout:
        rule = self.rules[name]
        probe = _probe(name, gt, rule, self.placement, rank)
        sel, shape = probe.selection, probe.shape
        nbytes = math.prod(shape) * DTYPE_SIZES[gt.dtype]
        segments = segments_for(gt, sel)
        assert nbytes == sum(s.nbytes for s in segments), name
        read = sum(bytes_read(s) for s in segments)
        info = gt.pieces[0].info
        replicated = self.placement.replicated(name, gt.shape, rule, rank, sel)
        described = probe.describe()
        return GroupLayout(sel, shape, nbytes, read, replicated, segments, str(info.file), info.start,
                           tensor_json(described), HeaderEncoder.entry_head(gt.dtype, shape), dcp_fragment(described))


def _probe(name: str, gt: GlobalTensor, rule: Rule, placement: Placement, rank: int) -> OutTensor:
    """Tensor `name` as `rank` holds it, with no reads planned (what its header entry describes)."""
    sel = placement.select(name, gt.shape, rule, rank)
    return OutTensor(name, gt.dtype, selection_shape(sel), gt.shape, rule.kind, dict(rule.options), sel, ())


def _group_keys(tensors: Mapping[str, GlobalTensor], rules: Mapping[str, Rule]) -> tuple[list[Any], Mapping[str, Any], Mapping[str, Any]]:
    """Per tensor in source order its group key, and per name what has its dtype and shape and what says
    where it starts. Tensors stored whole in one file group by (rule, name suffix, shape, dtype); any other
    is its own group (its name is its key)."""
    infos = whole_infos(tensors)
    if infos is not None:  # every tensor is whole: the keys below, read from the TensorInfos (no GlobalTensor made)
        keys = list(zip(map(id, map(rules.__getitem__, infos)), [n[n.rfind(".") :] if "." in n else "" for n in infos],
                        map(attrgetter("shape"), infos.values()), map(attrgetter("dtype"), infos.values())))
        return keys, infos, infos
    full = {shape: full_selection(shape) for shape in {gt.shape for gt in tensors.values()}}
    keys = [(id(rules[n]), n[n.rfind(".") :] if "." in n else "", gt.shape, gt.dtype)
            if len(gt.pieces) == 1 and (gt.pieces[0].select is full[gt.shape] or gt.pieces[0].select == full[gt.shape])
            else n for n, gt in tensors.items()]
    return keys, tensors, {n: gt.pieces[0].info for n, gt in tensors.items()}


def _file_order(names: list[str], meta: Mapping[str, Any]) -> list[str]:
    """`names` (sorted) in file order: largest item size first, then safetensors' dtype order, then name
    (`data_order`); `names` itself when every tensor has one dtype."""
    if len({t.dtype for t in meta.values()}) <= 1:
        return names
    by_dtype: dict[str, list[str]] = {}
    for n in names:
        by_dtype.setdefault(meta[n].dtype, []).append(n)
    return [n for dtype in sorted(by_dtype, key=lambda d: data_order("", d)) for n in by_dtype[dtype]]


def _places(infos: Iterable[Any]) -> list[tuple[str, int]]:
    """(file as a string, start) of each TensorInfo; a file's tensors usually share its path object,
    so each is made a string once."""
    infos = list(infos)
    files = list(map(attrgetter("file"), infos))
    ids = list(map(id, files))
    paths = {i: str(f) for i, f in dict(zip(ids, files)).items()}
    return list(zip(map(paths.__getitem__, ids), map(attrgetter("start"), infos)))


class LazyRanks(LazySequence[RankPlan]):
    """`Plan.ranks` for a caller that visits each rank once (`reshard plan`'s summary): a rank is
    planned when it is read and not kept, so only one rank's header is in memory at a time."""

    def __init__(self, planner: LayoutPlanner, ranks: Sequence[int]) -> None:
        self._planner, self._ranks = planner, list(ranks)
        for r in self._ranks:  # every error now, before a caller prints anything
            planner.layouts(r)

    def __len__(self) -> int:
        return len(self._ranks)

    def _item(self, i: int) -> RankPlan:
        with paused_gc():
            return self._planner.plan(self._ranks[i])


_REPLICATE = Rule("*", "replicate")


def resolve_rules(ckpt_tensors: Sequence[str], manifest: Manifest, *, strict: bool = False) -> tuple[dict[str, Rule], list[str]]:
    """Each tensor's rule (default replicate) and warnings for rules that match nothing."""
    matched = manifest.match_all(ckpt_tensors)
    chosen: dict[str, Rule] = dict(zip(ckpt_tensors, matched))  # type: ignore[arg-type]
    unmatched = [name for name, rule in chosen.items() if rule is None]
    for name in unmatched:
        chosen[name] = _REPLICATE
    if unmatched and manifest.strict:
        raise PlanError(
            f"{len(unmatched)} tensors match no rule and the manifest is strict, e.g. {unmatched[0]!r}; "
            "add a rule (kind replicate for norms) or drop `strict`"
        )
    used = set(map(id, chosen.values()))
    unused = [f"rule {r.pattern!r} ({r.kind}) matches no tensor" for r in manifest.rules if id(r) not in used]
    if unused and strict:
        raise PlanError(f"{unused[0]}; {len(unused)} such rules under --strict")
    return chosen, unused


class LayoutPlanner:
    """Plans every rank of a layout: one `RankPlanner` per set of tensors some ranks share (a pipeline
    stage, the experts they hold), made when a rank of it is first asked for."""

    def __init__(self, tensors: Mapping[str, GlobalTensor], files: dict[str, tuple[int, int | str]],
                 rules: Mapping[str, Rule], placement: Placement, *, manifest_source: str = "rules",
                 recorded: tuple[str | None] | None = None) -> None:
        # tensors of one rule placed differently (experts) group apart: their rules split once, for every rank
        self.tensors, self.files, self.rules, self.placement = tensors, files, placement.rules_for(rules), placement
        self.manifest_source = manifest_source
        self.layout = placement.layout
        self._recorded = recorded  # (identity,): what rank files planned again at their own layout record
        self._planners: dict[tuple[int, ...], RankPlanner] = {}

    @functools.cached_property
    def plan_id(self) -> str | None:
        """The plan's identity, which every rank's header records (`reshard.format.rank_file.plan_identity`);
        rank files planned at their own layout keep the one they record (None where they record none)."""
        if self._recorded is not None:
            return self._recorded[0]
        rules = {id(r): rule_json(r.kind, r.options) for r in self.rules.values()}  # the rules outlive this
        return plan_identity(self.layout.given(), ((n, gt.shape, rules[id(self.rules[n])]) for n, gt in self.tensors.items()))

    def planner(self, rank: int) -> RankPlanner:
        self.layout.check_rank(rank)
        if self.layout.tp_only:
            key, c = (), None
        else:
            c = self.layout.coords(rank)
            key = self.placement.subset(c)
        hit = self._planners.get(key)
        if hit is None:
            held = self.tensors if c is None else self.placement.held(self.tensors, c)
            hit = self._planners[key] = RankPlanner(held, self.files, self.rules, self.placement,
                                                    manifest_source=self.manifest_source, plan_id=self.plan_id)
        return hit

    def layouts(self, rank: int) -> list[GroupLayout]:
        return self.planner(rank).layouts(rank)

    def plan(self, rank: int) -> RankPlan:
        return self.planner(rank).plan(rank)

    def forget(self, rank: int) -> None:
        """Drop the layouts kept for a second `plan(rank)` (a RankPlan holds its own)."""
        self.planner(rank).forget(rank)

    def descriptions(self, rank: int) -> dict[str, str]:
        """What `plan(rank)`'s header says of each tensor the rank holds (`tensor_json` of its kind, options,
        global shape and selection), with no reads planned: for rank files that describe themselves
        (`reshard merge` checks them against it)."""
        self.layout.check_rank(rank)
        held = self.tensors if self.layout.tp_only else self.placement.held(self.tensors, self.layout.coords(rank))
        return {n: tensor_json(_probe(n, gt, self.rules[n], self.placement, rank).describe()) for n, gt in held.items()}


def as_layout(layout: Layout | int) -> Layout:
    """A `Layout`; an integer is plain tensor parallelism of that size."""
    if isinstance(layout, Layout):
        return layout
    if type(layout) is not int:
        raise PlanError(f"tp={layout!r} must be an integer from 1 to {MAX_WORLD}")
    return Layout(tp=layout)


def make_planner(ckpt: Source, manifest: Manifest, layout: Layout | int, *,
                 strict: bool = False) -> tuple[LayoutPlanner, Plan]:
    """The planner of every rank of `layout` (its tensor groups made as ranks are asked for) and the plan
    it belongs to, with no rank planned yet (`Plan.ranks` empty): for a caller that plans ranks as they
    are asked for."""
    layout = as_layout(layout)
    with paused_gc():
        tensors, files = ckpt.global_tensors(), source_files(ckpt)
        rules, warnings = resolve_rules(list(tensors), manifest, strict=strict)
        roles = None
        if not layout.tp_only:
            infos = whole_infos(tensors)  # the same shapes, without making every GlobalTensor
            shapes = {n: i.shape for n, i in (infos if infos is not None else tensors).items()}
            roles = source_roles(getattr(ckpt, "config", None), shapes)
        placement = Placement(layout, roles)
        placement.check()
        # rank files at the layout they were written in: the same files again, their recorded identity included
        recorded = (ckpt.recorded_plan,) if getattr(ckpt, "layout", None) == layout and hasattr(ckpt, "recorded_plan") else None
        planner = LayoutPlanner(tensors, files, rules, placement, manifest_source=manifest.source, recorded=recorded)
    identity: dict[str, Any] = {"source": ckpt.identity(), "manifest": manifest.digest(), "tp": layout.tp, "format": FORMAT,
                                "header": HEADER_REVISION}
    if roles is not None:
        identity.update(layout=layout.sizes(), roles=roles.digest())
    return planner, Plan(layout, (), manifest, identity, tuple(warnings))


def make_plan(
    ckpt: Source, manifest: Manifest, layout: Layout | int | None = None, *, tp: int | None = None,
    ranks: Sequence[int] | None = None, strict: bool = False, lazy: bool = False,
) -> Plan:
    """Plan `ranks` (default all) of `layout` (a `Layout`, or an integer: tp alone; `tp=` says the same);
    pure: reads no tensor data. With `lazy`, each rank is planned when `plan.ranks[i]` is read, and not
    kept (for one pass over the ranks with little memory)."""
    if (layout is None) == (tp is None):
        raise PlanError("give make_plan a layout (a Layout, or tp as an integer) or tp=, not both")
    layout = as_layout(layout if layout is not None else tp)  # type: ignore[arg-type]
    for r in ranks or ():
        layout.check_rank(r)
    planner, plan = make_planner(ckpt, manifest, layout, strict=strict)
    wanted = ranks if ranks is not None else range(layout.world)
    with paused_gc():
        rank_plans: Sequence[RankPlan] = LazyRanks(planner, wanted) if lazy else tuple(planner.plan(r) for r in wanted)
    return dataclasses.replace(plan, ranks=rank_plans)

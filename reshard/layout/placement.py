"""Which tensors a rank of a layout holds, and which part of each: TP, then FSDP, experts, stages.

For rank r with coordinates c (`Layout.coords`), tensor t of role `Roles[t]`:

1. pipeline: t is on r only if `c.pp` is one of its stages;
2. experts: a tensor expert parallelism splits (ep > 1 and the ep plan names its parameter) is not
   split by tp (the ep plan takes precedence, as in transformers); its expert axis is cut in
   `chunk(E, ep)[c.ep]`, then that in `chunk(., efsdp)[c.efsdp]`. Without ep, FSDP cuts a fused
   expert parameter's expert axis in `chunk(E, fsdp)[c.fsdp]`. A per-expert disk tensor is on r only
   if its index falls in that range (whole); a fused one on disk keeps that range of its dim 0;
3. tensor parallelism: every other tensor gets the selection its rule's kind gives rank `c.tp` of tp;
4. FSDP: then dim 0 of what TP selected is cut as FSDP2's `fully_shard` holds it (`chunk`, a shorter
   or empty last part) for rank `c.fsdp` of fsdp. dp_replicate replicates.

Selections are in global indices (`reshard.format.selection`), so a rank file's self-description
says exactly which part it holds, whatever the layout.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np

from reshard.errors import PlanError
from reshard.format.checkpoint import GlobalTensor, WholeTensors, whole_infos
from reshard.format.rank_file import RankMeta, RankPlace
from reshard.format.selection import Interval, Selection, full_selection
from reshard.layout.mesh import Coords, Layout, chunk
from reshard.layout.roles import Role, Roles
from reshard.rules.kinds import tensor_selection
from reshard.rules.manifest import Rule

COORDS = ("pp", "dp_replicate", "fsdp", "tp", "efsdp", "ep")  # the order a rank file records its coordinates in


def take(intervals: tuple[Interval, ...], lo: int, hi: int) -> tuple[Interval, ...]:
    """Positions [lo, hi) of the indices `intervals` list in order, as intervals of the same indices."""
    out, pos = [], 0
    for a, b in intervals:
        n = b - a
        s, e = max(lo - pos, 0), min(hi - pos, n)
        if s < e:
            out.append((a + s, a + e))
        pos += n
    return tuple(out)


class Placement:
    """The placement of every tensor of one checkpoint on every rank of `layout` (see the module
    docstring); `roles` may be None for a TP-only layout."""

    def __init__(self, layout: Layout, roles: Roles | None = None) -> None:
        if roles is None and not layout.tp_only:
            raise PlanError(f"{layout.describe()}: placing tensors beyond tp needs their roles")
        self.layout, self.roles = layout, roles

    # --- which rank holds what -----------------------------------------------------------------

    def role(self, name: str) -> Role:
        return self.roles[name] if self.roles is not None else Role()

    def experts(self, role: Role, c: Coords) -> tuple[int, int]:
        """The range of its expert axis a rank holds of a tensor with `role.experts` experts."""
        return self._experts(role.experts, role.ep, c)

    def _experts(self, n: int, ep: bool, c: Coords) -> tuple[int, int]:
        lay = self.layout
        if ep and lay.ep > 1:
            a, b = chunk(n, lay.ep, c.ep)
            lo, hi = chunk(b - a, lay.efsdp, c.efsdp)
            return a + lo, a + hi
        return chunk(n, lay.fsdp, c.fsdp)

    def held(self, tensors: Mapping[str, GlobalTensor], c: Coords) -> Mapping[str, GlobalTensor]:
        """The tensors of `tensors` rank `c` holds (a part of), in the same order and of the same kind:
        those of its pipeline stage, per-expert tensors only of the experts it holds."""
        roles = self.roles
        assert roles is not None and list(tensors) == roles.names
        keep = roles.on_stage(c.pp, self.layout.pp)
        for n, ep, these in roles.expert_kinds():
            lo, hi = self._experts(n, ep, c)
            keep &= ~these | ((lo <= roles.expert) & (roles.expert < hi))
        names = list(map(roles.names.__getitem__, np.flatnonzero(keep).tolist()))
        infos = whole_infos(tensors)
        if infos is not None:  # the same mapping as below, without making every GlobalTensor
            return WholeTensors({n: infos[n] for n in names})
        return {n: tensors[n] for n in names}

    def subset(self, c: Coords) -> tuple[Any, ...]:
        """Ranks with the same subset key hold the same tensors (each its own part of them): those of one
        pipeline stage holding the same range of experts of every kind of per-expert tensor."""
        if self.layout.tp_only or self.roles is None:
            return ()
        return (c.pp, *(self._experts(n, ep, c) for n, ep, _ in self.roles.expert_kinds()))

    # --- which part ------------------------------------------------------------------------------

    def rules_for(self, rules: Mapping[str, Rule]) -> Mapping[str, Rule]:
        """Each tensor's rule as the planner should group by: one object per rule and role kind (tensors
        of one rule whose roles differ are placed differently); the rules themselves for TP-only layouts."""
        roles = self.roles
        if roles is None:
            return rules
        chosen = list(map(rules.__getitem__, roles.names))
        keys = list(zip(map(id, chosen), roles.kinds.tolist()))
        placed = {key: copy.copy(rule) if key[1] else rule for key, rule in dict(zip(keys, chosen)).items()}
        return dict(zip(roles.names, map(placed.__getitem__, keys)))

    def select(self, name: str, shape: tuple[int, ...], rule: Rule, rank: int) -> Selection:
        """The part of tensor `name` (global `shape`) rank `rank` holds."""
        lay = self.layout
        if lay.tp_only:
            return tensor_selection(name, shape, rule, rank, lay.tp)
        c = lay.coords(rank)
        role = self.role(name)
        if role.ep and lay.ep > 1:
            sel = list(full_selection(shape))
            if role.expert is None and shape:
                sel[0] = (self.experts(role, c),)
            return tuple(sel)
        sel = tensor_selection(name, shape, rule, c.tp, lay.tp)
        if lay.fsdp == 1 or not shape or role.buffer:  # FSDP shards parameters, not buffers
            return sel
        if role.experts:  # FSDP's dim 0 of a fused expert parameter is its expert axis
            if role.expert is not None:
                return sel
            return (take(sel[0], *self.experts(role, c)), *sel[1:])
        local = sum(b - a for a, b in sel[0])
        return (take(sel[0], *chunk(local, lay.fsdp, c.fsdp)), *sel[1:])

    def replicated(self, name: str, shape: tuple[int, ...], rule: Rule, rank: int, sel: Selection) -> bool:
        """Whether rank `rank` holds tensor `name` (its part `sel`) whole, as another rank of its model
        replica (its pipeline stage of one dp_replicate group: the fsdp x tp ranks that split tensors) does:
        a tensor every rank of a TP group holds, not an expert only this rank holds."""
        if sel != full_selection(shape):
            return False
        lay = self.layout
        if lay.tp_only:
            return True  # (as every rank of the TP group holds it)
        c = lay.coords(rank)
        role = self.role(name)
        first = rank - (c.fsdp * lay.tp + c.tp)
        for peer in range(first, first + lay.fsdp * lay.tp):
            if peer == rank:
                continue
            if role.expert is not None:
                lo, hi = self.experts(role, lay.coords(peer))
                if not lo <= role.expert < hi:
                    continue
            if self.select(name, shape, rule, peer) == sel:
                return True
        return False

    # --- what a rank file says about itself ------------------------------------------------------

    def place(self, rank: int) -> RankPlace:
        """Where rank `rank`'s file sits, as the file records it (`reshard.format.rank_file`): tp and the
        rank, and beyond TP the layout's sizes other than 1 (tp always, in `DIMS` order) and its coordinates."""
        lay = self.layout
        if lay.tp_only:
            return RankPlace(lay.tp, rank)
        c = lay.coords(rank)
        return RankPlace(lay.tp, rank, lay.given(),
                         {k: getattr(c, k) for k in COORDS})

    def check(self) -> None:
        """Errors a layout meets only with this checkpoint: more stages than layers, experts ep cannot split."""
        lay, roles = self.layout, self.roles
        if roles is None:
            return
        if lay.pp > 1:
            if not roles.stack:
                arch = roles.spec["model_type"] or "this checkpoint (no model_type)"
                pre = f"{roles.spec['prefix']}." if roles.spec["prefix"] else ""
                raise PlanError(f"pp={lay.pp}: no tensor of this {arch} checkpoint is in a decoder layer of its pipeline "
                                f"plan ({pre}{{{','.join(roles.spec['pp_plan'])}}}.N), so its stages are unknown; use pp=1")
            layers = roles.num_layers
            if layers < lay.pp:
                raise PlanError(f"pp={lay.pp} is more pipeline stages than the {layers} layers of this model "
                                f"(each stage holds at least one); pick pp from 1 to {max(layers, 1)}")
            roles.on_stage(0, lay.pp)  # a layer past num_hidden_layers is an error now
        if lay.ep > 1:
            if not roles.has_ep_plan:
                raise PlanError(f"ep={lay.ep}: this architecture declares no expert-parallel plan "
                                "(base_model_ep_plan), so nothing is split by expert; use ep=1")
            counts = roles.ep_expert_counts()
            if not counts:
                raise PlanError(f"ep={lay.ep}: no tensor of this checkpoint is one the expert-parallel plan splits; "
                                "use ep=1")
            bad = [n for n in counts if n % lay.ep]
            if bad:
                good = [e for e in range(lay.tp, lay.fsdp * lay.tp + 1, lay.tp)
                        if (lay.fsdp * lay.tp) % e == 0 and all(n % e == 0 for n in counts)]
                choice = f"pick ep in {{{','.join(map(str, good))}}}" if good else "no ep above 1 divides them all: use ep=1"
                raise PlanError(f"ep={lay.ep} does not divide the {bad[0]} experts of a layer; {choice}")


def describe_layout(meta: RankMeta, where: str) -> Layout:
    """The layout a rank file's decoded metadata records (TP-only files record only tp)."""
    if meta.layout is not None:
        return Layout.from_obj(meta.layout, where=f"{where}: metadata `layout`")
    return Layout(tp=meta.tp)

"""A digest of everything a plan determines about the shard bytes: every rank's header and, per tensor,
its data offsets and source byte runs (file base names, not paths). Equal digests: equal shards."""

from __future__ import annotations

import hashlib
import os
from typing import Any


def _extent(e: Any) -> Any:
    if hasattr(e, "parts"):
        return ("il", tuple(_extent(p) for p in e.parts))
    return (e.file and os.path.basename(e.file), e.offset, e.run, e.count, e.stride)


def plan_digest(ranks: Any) -> str:
    h = hashlib.sha256()
    for rp in ranks:
        h.update(b"rank %d of %d|" % (rp.rank, rp.world))
        h.update(rp.header)
        for t in rp.tensors:
            h.update(repr((t.name, t.dtype, t.shape, t.begin, t.end, tuple(map(_extent, t.segments)))).encode())
    return h.hexdigest()


def reference_plan(ckpt: Any, manifest: Any, tp: int) -> list[Any]:
    """Every rank planned tensor by tensor, as `reshard.plan.planner.plan_rank` did before the grouped planner:
    each tensor's own selection, `segments_for` and description, then `layout` (sort + `encode_header`)."""
    from reshard.format.rank_file import RankPlace, encode_metadata, plan_identity, rule_json
    from reshard.format.selection import selection_shape
    from reshard.plan.planner import resolve_rules
    from reshard.plan.segments import layout, segments_for
    from reshard.plan.types import OutTensor, source_files
    from reshard.rules.kinds import tensor_selection

    tensors, files = ckpt.global_tensors(), source_files(ckpt)
    rules, _ = resolve_rules(list(tensors), manifest)
    plan = plan_identity({"tp": tp}, [(n, gt.shape, rule_json(rules[n].kind, rules[n].options)) for n, gt in tensors.items()])
    ranks = []
    for rank in range(tp):
        items = []
        for name, src in tensors.items():
            rule = rules[name]
            sel = tensor_selection(name, src.shape, rule, rank, tp)
            items.append(OutTensor(name, src.dtype, selection_shape(sel), src.shape, rule.kind, dict(rule.options),
                                   sel, segments_for(src, sel)))
        meta = encode_metadata(RankPlace(tp, rank, plan=plan), {t.name: t.describe() for t in items})
        ranks.append(layout(items, meta, files, rank=rank, world=tp))
    return ranks

"""`reshard merge`: rank shards back to a full HF checkpoint, from the shards' own metadata.

Each output file is planned like a rank file (every tensor whole, from the pieces the ranks hold,
padding dropped) and streamed in bounded chunks: no tensor is ever materialized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.errors import PlanError
from reshard.format.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from reshard.format.selection import full_selection
from reshard.io.outfs import (
    check_space,
    fsync_dir,
    output_errors,
    prepare_dir,
    remove_stale_temps,
    write_json_atomic,
)
from reshard.io.progress import Progress
from reshard.io.sinks.writer import write_files
from reshard.io.source.opener import open_shards
from reshard.io.source.rank_dir import ShardSet
from reshard.io.source.remote_dir import copy_beside
from reshard.plan.segments import layout, segments_for
from reshard.plan.types import OutTensor, RankPlan, source_files

DEFAULT_MAX_FILE = 5 * 10**9
_RETRY = "run the same merge again"


def merge_plans(shards: ShardSet, *, max_file_bytes: int = DEFAULT_MAX_FILE) -> list[tuple[str, RankPlan]]:
    """The output files (HF names) and their plans: tensors in name order, a new file past `max_file_bytes`."""
    if max_file_bytes <= 0:
        raise PlanError(f"max file size {max_file_bytes} must be positive")
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for name, gt in shards.global_tensors().items():
        sel = full_selection(gt.shape)
        if groups[-1] and size + gt.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(OutTensor(name, gt.dtype, gt.shape, gt.shape, "replicate", {}, sel, segments_for(gt, sel)))
        size += gt.nbytes
    files = source_files(shards)
    n = len(groups)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return [(fname, layout(g, {"format": "pt"}, files)) for fname, g in zip(names, groups)]


def merge(src: str | Path, out: str | Path, *, max_file_bytes: int = DEFAULT_MAX_FILE,
          progress: bool | None = None) -> dict[str, Any]:
    """Merge the rank shards in `src` into an HF checkpoint in `out`; returns a summary."""
    shards = open_shards(src)
    plans = merge_plans(shards, max_file_bytes=max_file_bytes)
    out = prepare_dir(out)
    with output_errors(out, retry=_RETRY):
        remove_stale_temps(out)
        check_space(out, sum(p.size for _, p in plans) + (64 << 10), fix=f"free some space there or merge elsewhere, then {_RETRY}")
        bar = Progress(sum(p.size for _, p in plans), "merge", enabled=progress)
        write_files([(plan, out / fname, lambda d: None) for fname, plan in plans], on_bytes=bar.update, retry=_RETRY)
        fsync_dir(out)
        bar.close()
        total = shards.total_bytes()  # every tensor whole: what the merged files hold
        if len(plans) > 1:
            weight_map = {t.name: fname for fname, p in plans for t in p.tensors}
            write_json_atomic(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        if shards.config is not None:  # read (and validated) from config.json when the shards were opened
            copy_beside(shards.root, CONFIG_NAME, out / CONFIG_NAME)
    return {"files": [f for f, _ in plans], "tensors": len(shards.tensors), "bytes": total, "tp": shards.tp,
            "layout": shards.layout.sizes()}

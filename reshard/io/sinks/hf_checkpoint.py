"""`reshard merge`: rank shards, or a torch DCP checkpoint, back to a full HF checkpoint.

The source describes itself: rank files by their metadata, a DCP checkpoint by its `.metadata` or its
`DCP_SHARDING_INFO` (`reshard.io.source.dcp_dir`). Each output file is planned like a rank file (every
tensor whole, from the pieces the ranks hold, padding dropped) and streamed in bounded chunks: no tensor
is ever materialized. Before anything is written the pieces are checked to make one checkpoint: the
recorded digests (`check_recorded`), then the plan, the replicas and the model's shapes
(`reshard.io.sinks.merge_checks`).

With `optimizer=True` a training checkpoint's AdamW state (`SRC/optimizer/`, `reshard.format.rank_file`)
is merged too, one HF-shaped checkpoint per moment under the parameters' own names:
`OUT/optimizer/exp_avg/` and `OUT/optimizer/exp_avg_sq/`, each `model.safetensors` (or
`model-0000X-of-0000N.safetensors` + index) and `config.json`, like the weights in `OUT`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError, IntegrityError, PlanError
from reshard.format.checkpoint import INDEX_NAME, MANIFEST_NAME, SINGLE_NAME, parse_json
from reshard.format.rank_file import (
    OPTIMIZER_DIR,
    OPTIMIZER_SLOTS,
    TRAINER_STATE_NAME,
    parse_optimizer_tensor_name,
)
from reshard.format.selection import full_selection
from reshard.io.hashing import file_sha256
from reshard.io.outfs import (
    check_space,
    fsync_dir,
    output_errors,
    prepare_dir,
    remove_stale_temps,
    write_json_atomic,
)
from reshard.io.progress import Progress
from reshard.io.sinks.merge_checks import check_merge
from reshard.io.sinks.target import check_not_source
from reshard.io.sinks.writer import write_files
from reshard.io.source.dcp_dir import DcpCheckpoint
from reshard.io.source.opener import open_pieces, open_shards
from reshard.io.source.rank_dir import ShardSet
from reshard.io.source.remote_dir import copy_meta_files
from reshard.io.source.schemes import check_scheme
from reshard.io.source.stores import is_url
from reshard.io.verified import record, trusted
from reshard.plan.segments import layout, segments_for
from reshard.plan.types import OutTensor, RankPlan, source_files

DEFAULT_MAX_FILE = 5 * 10**9
_RETRY = "run the same merge again"


def merge_plans(shards: ShardSet | DcpCheckpoint, *, max_file_bytes: int = DEFAULT_MAX_FILE,
                rename: Mapping[str, str] | None = None) -> list[tuple[str, RankPlan]]:
    """The output files (HF names) and their plans: tensors in name order, a new file past `max_file_bytes`.
    With `rename` (shard tensor name -> output name) only the tensors it names, under their new names."""
    if max_file_bytes <= 0:
        raise PlanError(f"max file size {max_file_bytes} must be positive")
    groups: list[list[OutTensor]] = [[]]
    size = 0
    found = shards.global_tensors()
    chosen = sorted((rename[n], gt) for n, gt in found.items() if n in rename) if rename is not None else found.items()
    for name, gt in chosen:
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
          progress: bool | None = None, optimizer: bool = False) -> dict[str, Any]:
    """Merge the rank shards (or the DCP checkpoint) in `src` into an HF checkpoint in `out`; returns a
    summary. With `optimizer`, `src` is a training checkpoint and its AdamW moments are merged too (the
    module docstring)."""
    check_scheme(out)
    shards = open_pieces(src)
    check_not_source(out, shards.root, command="merge", shards=True)
    if optimizer and isinstance(shards, DcpCheckpoint):
        raise CheckpointError(f"{src}: --optimizer merges a reshard training checkpoint's AdamW rank files; this is a "
                              "DCP checkpoint: drop --optimizer")
    moments = open_shards(_optimizer_src(src)) if optimizer else None  # refused before anything is written
    for s in (shards, moments):
        if s is not None:
            check_recorded(s)
    check_merge(shards)  # the plan, the replicas, the model's shapes (`merge_checks`)
    if moments is not None:
        check_merge(moments, config=shards.config, names={n: p[0] for n in moments.tensors
                                                          if (p := parse_optimizer_tensor_name(n))})
    summary = _merge_into(shards, out, merge_plans(shards, max_file_bytes=max_file_bytes), progress)
    if moments is not None:
        summary["optimizer"] = {}
        for slot in OPTIMIZER_SLOTS:
            names = {n: p[0] for n in moments.tensors if (p := parse_optimizer_tensor_name(n)) and p[1] == slot}
            plans = merge_plans(moments, max_file_bytes=max_file_bytes, rename=names)
            where = Path(out) / OPTIMIZER_DIR / slot
            summary["optimizer"][slot] = {"dir": f"{OPTIMIZER_DIR}/{slot}", **_merge_into(moments, where, plans, progress)}
    return summary


def check_recorded(shards: ShardSet) -> None:
    """Where the rank files' digests are recorded beside them (`reshard.json` of a write, a training
    checkpoint's `trainer_state.json`), the rank files must be the ones recorded and hash to them: a
    rank file of another write put in their place is refused before anything is merged."""
    if not isinstance(shards.root, Path):
        return  # a store's or the service's files: their digests are checked as they are read
    recorded: dict[str, str] = {}
    for where, prefix in ((shards.root / MANIFEST_NAME, ""), (shards.root / TRAINER_STATE_NAME, ""),
                          (shards.root.parent / TRAINER_STATE_NAME, f"{shards.root.name}/")):
        if where.is_file():
            files = parse_json(where.read_bytes(), str(where)).get("files") or {}
            recorded.update({k[len(prefix):]: v["sha256"] if isinstance(v, dict) else v
                             for k, v in files.items() if k.startswith(prefix) and "/" not in k[len(prefix):]})
            break
    if not recorded:
        return
    for info in shards.files:
        name = Path(info.path).name
        if name not in recorded:
            raise IntegrityError(f"{info.path}: not among the rank files {where.name} records beside it: a file of "
                                 "another write; write or save the checkpoint again")
        check_file(info.path, recorded[name], fix="a file of another write, or damaged; write or save it again")


def check_file(path: str | Path, sha256: str, *, fix: str) -> None:
    """`IntegrityError` (naming the file and `fix`) unless `path` hashes to `sha256`: trusted without
    hashing while it is unchanged since it was verified or written (`reshard.io.verified`), else hashed
    (and recorded)."""
    with open(path, "rb") as f:
        if trusted(f.fileno(), sha256):
            return
        got = file_sha256(Path(path))
        if got != sha256:
            raise IntegrityError(f"{path}: sha256 {got[:16]}... does not match the recorded {sha256[:16]}...: {fix}")
        record(f.fileno(), sha256, path=path)


def _optimizer_src(src: str | Path) -> str | Path:
    """`SRC/optimizer`: a training checkpoint's AdamW rank files (one clear error when there are none)."""
    if is_url(src):
        return f"{str(src).rstrip('/')}/{OPTIMIZER_DIR}"
    if not (Path(src) / OPTIMIZER_DIR).is_dir():
        raise CheckpointError(f"{src}: no {OPTIMIZER_DIR}/ here, so no optimizer state to merge; merge a training "
                              "checkpoint saved by `reshard.cli.train --save`, or drop --optimizer")
    return Path(src) / OPTIMIZER_DIR


def _merge_into(shards: ShardSet | DcpCheckpoint, out: str | Path, plans: list[tuple[str, RankPlan]],
                progress: bool | None) -> dict[str, Any]:
    """Write `plans` (from `merge_plans`) into `out`, with the index when several and `config.json`."""
    out = prepare_dir(out)
    with output_errors(out, retry=_RETRY):
        remove_stale_temps(out)
        check_space(out, sum(p.size for _, p in plans) + (64 << 10), fix=f"free some space there or merge elsewhere, then {_RETRY}")
        bar = Progress(sum(p.size for _, p in plans), "merge", enabled=progress)
        write_files([(plan, out / fname, lambda d: None) for fname, plan in plans], on_bytes=bar.update, retry=_RETRY)
        fsync_dir(out)
        bar.close()
        total = sum(t.nbytes for _, p in plans for t in p.tensors)  # every tensor whole: what the merged files hold
        if len(plans) > 1:
            weight_map = {t.name: fname for fname, p in plans for t in p.tensors}
            write_json_atomic(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        kept = copy_meta_files(shards.root, out)  # config.json (validated when the shards were opened), tokenizer...
    done = {"files": [f for f, _ in plans], "kept": kept, "tensors": sum(len(p.tensors) for _, p in plans), "bytes": total}
    if isinstance(shards, DcpCheckpoint):
        return {**done, "source": shards.kind, "left_out": list(shards.left_out)}
    return {**done, "tp": shards.tp, "layout": shards.layout.sizes()}

"""Training checkpoints: the whole training state saved atomically, and restored for a resume.

A checkpoint directory holds

    rank-RRRRR-of-WWWWW.safetensors             the parameters, as `save_rank_shard` writes them
    optimizer/rank-RRRRR-of-WWWWW.safetensors   AdamW's exp_avg and exp_avg_sq, named and described by
                                                `reshard.format.rank_file` (each cut like its parameter)
    config.json, optimizer/config.json          the model's config
    trainer_state.json                          the rest, as JSON (`reshard.trainer.state_json`)

The rank files are of the layout the run holds its tensors in: tp, or fsdp x tp (each rank's local
parts of its FSDP-sharded parameters and moments: the files `reshard write --fsdp F --tp T` makes).
Each rank writes only its own share; nothing is gathered. Everything goes into a temp directory beside the target
(`.NAME.partial-TOKEN`); rank 0 writes `trainer_state.json` last, with every file's sha256, then
publishes the directory with one rename. A crash mid-save leaves the previous checkpoint as it was and
no directory under the checkpoint's name. (Ranks whose `--save` is a directory of their own, on a disk
of their own, publish theirs the same way, one rank per directory.)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from reshard.format.checkpoint import CONFIG_NAME
from reshard.format.meta_files import KEPT_NAMES
from reshard.format.rank_file import (
    OPTIMIZER_DIR,
    OPTIMIZER_SLOTS,
    optimizer_tensor_name,
    rank_file_name,
)
from reshard.io.outfs import (
    atomic_file,
    copy_atomic,
    fsync_dir,
    output_errors,
    prepare_dir,
    write_json_atomic,
)
from reshard.io.source.stores import is_url
from reshard.trainer.groups import all_gather_json
from reshard.trainer.names import local, shard_targets
from reshard.trainer.save import RETRY, write_rank_file
from reshard.trainer.state_json import STATE_NAME, encode_state, model_fingerprint, rng_snapshot

__all__ = ["every_n_steps", "moment_targets", "prune_checkpoints", "save_checkpoint", "step_dir"]

_STEP_DIR = re.compile(r"step-(\d+)")
_CLAIM = ".publishing"


def step_dir(root: Path, step: int) -> Path:
    """`ROOT/step-N`: where `--save-every` puts the checkpoint of step N."""
    return Path(root) / f"step-{step}"


def moment_targets(model: nn.Module, optimizer: torch.optim.Optimizer, slot: str) -> dict[str, torch.Tensor]:
    """Shard tensor name -> the view of the optimizer's `slot` tensor that mirrors the parameter view the
    name fills (a moment has its parameter's shape and strides; under FSDP, its local part the parameter's).
    A parameter without state gets zeros."""
    params = {local(p).untyped_storage().data_ptr(): p for p in model.parameters()}
    out = {}
    for name, view in shard_targets(model, model.rank_header.tensors).items():
        p = params.get(view.untyped_storage().data_ptr())
        if p is None:
            continue  # a buffer: no optimizer state
        state = optimizer.state[p]
        if slot not in state:
            state[slot] = torch.zeros_like(p, memory_format=torch.preserve_format)
        m, lp = local(state[slot]), local(p)  # under FSDP: this rank's parts of both
        out[name] = m.as_strided(view.shape, view.stride(), m.storage_offset() + view.storage_offset() - lp.storage_offset())
    return out


def _world(group: ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(obj: Any, group: ProcessGroup | None, device: torch.device) -> list[Any]:
    """`obj` (JSON-safe) of every rank of `group`, in group order (JSON over the wire, no pickle)."""
    return all_gather_json(obj, group, device=device) if _world(group)[1] > 1 else [obj]


def _barrier(group: ProcessGroup | None) -> None:
    if _world(group)[1] > 1:
        dist.barrier(group=group)


def save_checkpoint(
    out_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
    scheduler: Any | None = None, generators: Mapping[str, torch.Generator] | None = None,
    extra: Mapping[str, Any] | None = None, group: ProcessGroup | None = None,
) -> Path:
    """Write the training state at `step` to `out_dir` as one atomic checkpoint (the module docstring);
    a collective: every rank of `group` (the ranks of one copy of the model) calls it. `generators` are global (the same on every rank),
    `extra` is the loop's own JSON state. An existing checkpoint at `out_dir` is replaced."""
    rank, world = _world(group)
    final = Path(out_dir)
    device = next(model.parameters()).device  # where the gathers' tensors live (CUDA under NCCL)
    tmp = final.parent / f".{final.name}.partial-{_gather(time.time_ns(), group, device)[0]}"  # rank 0's token
    header = model.rank_header
    if world != header.layout.world:
        raise ValueError(f"save_checkpoint: a group of {world} ranks saves files of {header.layout.describe()}")
    place, fname = header.place, rank_file_name(header.rank, header.layout.world)
    try:
        with output_errors(final, retry=RETRY):
            prepare_dir(final.parent)
            for stale in final.parent.glob(f".{final.name}.partial-*"):  # what a crashed save left
                if stale != tmp:
                    shutil.rmtree(stale, ignore_errors=True)
            (tmp / OPTIMIZER_DIR).mkdir(parents=True, exist_ok=True)
        files = {fname: write_rank_file(tmp / fname, place, header.tensors, shard_targets(model, header.tensors))}
        moments = {optimizer_tensor_name(n, slot): t for slot in OPTIMIZER_SLOTS
                   for n, t in moment_targets(model, optimizer, slot).items()}
        specs = {optimizer_tensor_name(n, slot): header.tensors[n] for slot in OPTIMIZER_SLOTS for n in header.tensors}
        files[f"{OPTIMIZER_DIR}/{fname}"] = write_rank_file(tmp / OPTIMIZER_DIR / fname, place, specs, moments)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    gathered = _gather({"files": files, "rng": rng_snapshot()}, group, device)
    state = encode_state(step=step, layout=header.layout, files={k: v for g in gathered for k, v in g["files"].items()},
                         optimizer=type(optimizer).__name__, generators=generators or {}, extra=extra or {},
                         scheduler=scheduler.state_dict() if scheduler is not None else None,
                         rng=[g["rng"] for g in gathered],
                         model=model_fingerprint(getattr(model, "hf_config", None), header.tensors))
    if rank == 0:
        _finish(tmp, final, state, getattr(model, "hf_config", None), getattr(model, "source", None))
    _barrier(group)
    if rank != 0 and tmp.exists():  # not the directory rank 0 published: a disk of this rank's own
        with contextlib.suppress(FileExistsError, FileNotFoundError):
            os.mkdir(tmp / _CLAIM)  # one rank per such directory publishes it
            _finish(tmp, final, state, getattr(model, "hf_config", None), getattr(model, "source", None))
    _barrier(group)
    return final


def _finish(tmp: Path, final: Path, state: dict[str, Any], config: dict[str, Any] | None,
            source: str | None = None) -> None:
    """The small files, the JSON files (the trainer state last: what makes the directory a checkpoint),
    then publish."""
    with output_errors(final, retry=RETRY):
        copy_small_files(source, tmp)
        if config is not None:
            write_json_atomic(tmp / CONFIG_NAME, config)
            write_json_atomic(tmp / OPTIMIZER_DIR / CONFIG_NAME, config)
        write_json_atomic(tmp / STATE_NAME, state)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(tmp / _CLAIM)
        _publish(tmp, final)


def copy_small_files(source: str | None, dest: Path) -> list[str]:
    """The small files of the run's source other than its config (generation config, tokenizer files:
    `reshard.format.meta_files.KEPT_NAMES`) into `dest`, so the checkpoint, and `reshard merge` of it,
    keeps them; from the service's URL they are fetched (each checked against its listed sha256)."""
    names = [n for n in KEPT_NAMES if n != CONFIG_NAME]
    copied = []
    if source is None:
        return copied
    if is_url(source):
        from reshard.io.client.shard_client import ShardClient  # httpx only for a URL

        with ShardClient(source) as client:
            for entry in client.meta_listing():  # one listing; each file checked against it as it arrives
                if entry["name"] in names:
                    with atomic_file(dest / entry["name"]) as f:
                        for _pos, _size, piece in client.meta_pieces(entry):
                            f.write(piece)
                    copied.append(entry["name"])
        return copied
    root = Path(source).parent if Path(source).is_file() else Path(source)
    for name in names:
        if (root / name).is_file():
            copy_atomic(root / name, dest / name)
            copied.append(name)
    return copied


def every_n_steps(root: str | Path | None, *, every: int, keep: int, step: int, model: nn.Module,
                  optimizer: torch.optim.Optimizer, group: ProcessGroup | None = None, **state: Any) -> Path | None:
    """`--save-every`: after `step`, when `every` divides it, the checkpoint `ROOT/step-N` (`state`: the
    keywords of `save_checkpoint`), keeping the last `keep` (0: all); the directory written, or None."""
    if root is None or not every or step % every:
        return None
    out = save_checkpoint(step_dir(Path(root), step), model, optimizer, step=step, group=group, **state)
    if keep and _world(group)[0] == 0:
        prune_checkpoints(root, keep=keep)
    return out


def _publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. An existing `final` is moved aside first, its `step-N` checkpoints moved into
    the new one, then it is removed; a publish that crashed half-way is completed first."""
    old = final.parent / f".{final.name}.old"
    if old.exists() and not final.exists():
        os.replace(old, final)  # a crash between the two renames: the old checkpoint comes back
    if old.exists():
        _carry_steps(old, final)
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        _carry_steps(old, final)
        shutil.rmtree(old)


def _carry_steps(src: Path, dst: Path) -> None:
    for p in src.iterdir():
        if _STEP_DIR.fullmatch(p.name) and not (dst / p.name).exists():
            os.replace(p, dst / p.name)
    fsync_dir(dst)


def prune_checkpoints(root: str | Path, *, keep: int) -> list[Path]:
    """Remove all but the last `keep` `step-N` checkpoints under `root` (rank 0 only); the removed ones."""
    found = sorted((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.fullmatch(p.name)))
    gone = [p for _, p in found[:-keep]] if keep > 0 else []
    for p in gone:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(p)
    return gone

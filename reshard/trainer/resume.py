"""Resume from a training checkpoint (`reshard.trainer.snapshot`): the optimizer's moments and step, the
LR scheduler, the generators and the loop's own state, for the model `build_model` filled from it.

At the layout the checkpoint was saved at (tp, or fsdp x tp) the continuation is exact: every tensor is
read back bit for bit, each rank's default generator gets its own saved state, the global generators
(the data order) theirs. At another layout every rank reads its slices of the parameters and moments
cut as they are read (`reshard.fill.open.open_cut_stream`: the bytes `reshard write CKPT --tp Q ...`
would write), the global generators are restored and each rank's default generator is reseeded from
(seed, step, rank). A directory without `trainer_state.json` (an HF checkpoint, plain rank shards)
holds weights only: the run starts with a fresh optimizer at step 0.

`source` may be the service's URL of a checkpoint directory (`reshard serve --root ROOT`, ROOT/NAME the
checkpoint): `trainer_state.json` comes from its small files (`GET .../NAME/meta/trainer_state.json`,
checked against the listed sha256), the parameters from `.../NAME/shards/R`, the moments from
`.../NAME/optimizer/shards/R`, each rank pulling only its own share, cut by the service at any layout; at
the saved layout each is checked against the sha256 the checkpoint recorded, at another against the
service's digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reshard.errors import CheckpointError
from reshard.fill.into_params import fill_parameters, read_header_from
from reshard.fill.open import open_cut_stream
from reshard.format.rank_file import OPTIMIZER_DIR, OPTIMIZER_SLOTS, optimizer_tensor_name, rank_file_name
from reshard.io.source.stores import is_url
from reshard.layout.mesh import Layout
from reshard.trainer.snapshot import moment_targets
from reshard.trainer.state_json import STATE_NAME, check_state, decode_rng, model_fingerprint, read_state

__all__ = ["build_options", "reseed", "restore_training", "same_layout", "saved_layout", "start_step", "training_state",
           "weights_sha256"]


def training_state(source: str | Path) -> dict[str, Any] | None:
    """The checked trainer state of checkpoint `source` (its files all present; a URL: as the service
    lists it, sha256 checked); None for weights only."""
    if is_url(source):
        return _served_state(str(source))
    if not Path(source).is_dir():
        return None
    return read_state(Path(source))


def _served_state(url: str) -> dict[str, Any] | None:
    from reshard.io.client.shard_client import ShardClient  # httpx only for a URL

    with ShardClient(url) as client:
        data = client.meta_file(STATE_NAME)
    if data is None:
        return None
    where = f"{url}/meta/{STATE_NAME}"
    try:
        state = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{where}: unreadable trainer state ({e}); resume from an earlier checkpoint") from None
    return check_state(state, where)


def saved_layout(state: Mapping[str, Any]) -> Layout:
    """The layout the checkpoint's rank files are of."""
    return Layout.from_obj(state["layout"], where="trainer state `layout`")


def same_layout(state: Mapping[str, Any], layout: Layout) -> bool:
    """Whether the checkpoint was saved at `layout` (then it is read file by file, verified and exact)."""
    return saved_layout(state) == layout


def weights_sha256(state: Mapping[str, Any], rank: int, layout: Layout) -> str | None:
    """The recorded sha256 of this rank's parameter file; None at another layout (its slices are cut
    from several files as they are read)."""
    return state["files"][rank_file_name(rank, layout.world)] if same_layout(state, layout) else None


def build_options(state: Mapping[str, Any] | None, rank: int, layout: Layout) -> dict[str, Any]:
    """The keywords of `build_model` for rank `rank` of `layout` from a checkpoint with trainer `state`
    (None: weights only): the parameter file's sha256 at the same layout (at another it is cut as read)."""
    sha = weights_sha256(state, rank, layout) if state is not None else None
    return {"sha256": sha} if sha else {}


def reseed(seed: int, step: int, rank: int) -> int:
    """The default generator's seed of `rank` resumed at `step` at another layout: a 63-bit hash of the three."""
    digest = hashlib.sha256(f"reshard.resume/{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def restore_training(
    state: Mapping[str, Any], source: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
    scheduler: Any | None = None, generators: Mapping[str, torch.Generator] | None = None, seed: int = 0,
) -> dict[str, Any]:
    """Fill `optimizer` (AdamW) from the checkpoint's moments of this rank, verified against their
    recorded sha256 (at another layout: cut from the saved files as read), and restore the scheduler, the
    generators and this rank's RNG (at another layout: reseeded from `seed`, the step and the rank); returns
    `{"step": N, "extra": {...}}` (the run continues at step N + 1)."""
    header = model.rank_header
    rank, layout = header.rank, header.layout
    if state.get("model") not in (None, model_fingerprint(getattr(model, "hf_config", None), header.tensors)):
        raise CheckpointError(f"{source}: its rank files or config.json are of another model than the one its "
                              f"{STATE_NAME} was saved with (names, shapes or config differ); resume from a "
                              "checkpoint as the trainer saved it")
    step, same = int(state["optimizer"]["step"]), same_layout(state, layout)
    for p in model.parameters():
        optimizer.state[p]["step"] = torch.tensor(float(step), dtype=_scalar_dtype())
    targets = {optimizer_tensor_name(n, slot): t for slot in OPTIMIZER_SLOTS
               for n, t in moment_targets(model, optimizer, slot).items()}
    _fill_moments(state, source, rank, layout, targets)
    if scheduler is not None:
        if state["scheduler"] is None:
            raise CheckpointError(f"{source}: the checkpoint has no LR scheduler state, this run has one; resume "
                                  "without the schedule or from a checkpoint saved with it")
        scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # the rate the next step uses (load_state_dict sets the schedule, not the optimizer)
    for key, gen in (generators or {}).items():
        if key not in state["generators"]:
            raise CheckpointError(f"{source}: the checkpoint has no generator {key!r}; save it with this trainer")
        gen.set_state(decode_rng(state["generators"][key]))
    if not same or "relaid_from" in state:  # cut to another layout, here or by `reshard write`: one rule
        seed = int(state["extra"].get("seed", seed))  # the run's own seed, as `reshard write` reseeds with it
        torch.manual_seed(reseed(seed, step, rank))  # all of torch's default generators, CUDA's included
        return {"step": step, "extra": dict(state["extra"])}
    mine = state["rng"][rank]
    torch.set_rng_state(decode_rng(mine["torch"]))
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode_rng(mine["cuda"]))
    return {"step": step, "extra": dict(state["extra"])}


def _fill_moments(state: Mapping[str, Any], source: str | Path, rank: int, layout: Layout,
                  targets: dict[str, torch.Tensor]) -> None:
    """This rank's moments into `targets`: its file verified against the recorded sha256 at the same
    layout, its slices cut from the saved files at another (by the service, for a URL)."""
    moments_at = f"{str(source).rstrip('/')}/{OPTIMIZER_DIR}" if is_url(source) else Path(source) / OPTIMIZER_DIR
    _, body, _, where = open_cut_stream(moments_at, rank, layout, need_config=False)
    try:
        moments, leftover = read_header_from(body, where)
        moments.check(rank, layout, fix=f"resume with the checkpoint's {saved_layout(state).describe()}")
        sha = state["files"][f"{OPTIMIZER_DIR}/{rank_file_name(rank, layout.world)}"] if same_layout(state, layout) \
            else None
        fill_parameters(moments, body, targets, sha256=sha, leftover=leftover, verify="always" if sha else "auto")
    finally:
        if hasattr(body, "close"):
            body.close()


def start_step(
    state: Mapping[str, Any] | None, source: str | Path | None, model: nn.Module, optimizer: torch.optim.Optimizer,
    *, scheduler: Any | None = None, generators: Mapping[str, torch.Generator] | None = None, seed: int = 0,
    say: bool = True,
) -> tuple[int, dict[str, Any]]:
    """The step a run starts after and the loop's own saved state: the checkpoint's (restored by
    `restore_training`), or (0, {}). `source` is what `--resume` named (None without one); with `say`,
    one line tells what was resumed."""
    got = restore_training(state, source, model, optimizer, scheduler=scheduler, generators=generators, seed=seed) \
        if state is not None and source is not None else {"step": 0, "extra": {}}
    if say and source is not None:
        saved = f" (saved at {saved_layout(state).describe()}, cut to {model.rank_header.layout.describe()} as read)" \
            if state is not None and not same_layout(state, model.rank_header.layout) else ""
        print(f"resumed from {source} at step {got['step']}{saved}" if state is not None else
              f"{source}: weights only (no {STATE_NAME}): starting with a fresh optimizer at step 0", flush=True)
    return got["step"], got["extra"]


def _scalar_dtype() -> torch.dtype:
    """The dtype AdamW keeps its `step` in (torch.optim.optimizer._get_scalar_dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32

"""Resume from a training checkpoint (`reshard.trainer.snapshot`): the optimizer's moments and step, the
LR scheduler, the generators and the loop's own state, for the model `build_model` filled from it.

At the layout the checkpoint was saved at the continuation is exact: every tensor is read back bit for
bit, each rank's default generator gets its own saved state, the global generators (the data order)
theirs. A directory without `trainer_state.json` (an HF checkpoint, plain rank shards) holds weights
only: the run starts with a fresh optimizer at step 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reshard.errors import CheckpointError
from reshard.fill.into_params import fill_parameters, read_header_from
from reshard.format.rank_file import OPTIMIZER_DIR, OPTIMIZER_SLOTS, optimizer_tensor_name, rank_file_name
from reshard.io.client.body import file_body
from reshard.io.source.stores import is_url
from reshard.layout.mesh import Layout
from reshard.trainer.snapshot import moment_targets
from reshard.trainer.state_json import STATE_NAME, decode_rng, read_state

__all__ = ["restore_training", "start_step", "training_state", "weights_sha256"]


def training_state(source: str | Path, *, tp: int) -> dict[str, Any] | None:
    """The checked trainer state of checkpoint `source` for a run at `tp`; None for weights only."""
    if is_url(source) or not Path(source).is_dir():
        return None
    state = read_state(Path(source))
    if state is not None and state["layout"]["tp"] != tp:
        saved = state["layout"]["tp"]
        raise CheckpointError(f"{source}: a training checkpoint of tp={saved}, this run has tp={tp}; resuming "
                              f"at another layout is not supported yet: resume with {saved} ranks")
    return state


def weights_sha256(state: Mapping[str, Any], rank: int, tp: int) -> str:
    """The recorded sha256 of this rank's parameter file."""
    return state["files"][rank_file_name(rank, tp)]


def restore_training(
    state: Mapping[str, Any], source: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
    scheduler: Any | None = None, generators: Mapping[str, torch.Generator] | None = None,
) -> dict[str, Any]:
    """Fill `optimizer` (AdamW) from the checkpoint's moments of this rank, verified against their
    recorded sha256, and restore the scheduler, the generators and this rank's RNG; returns
    `{"step": N, "extra": {...}}` (the run continues at step N + 1)."""
    header = model.rank_header
    rank, tp = header.rank, header.tp
    name = f"{OPTIMIZER_DIR}/{rank_file_name(rank, tp)}"
    path = Path(source) / name
    step = int(state["optimizer"]["step"])
    for p in model.parameters():
        optimizer.state[p]["step"] = torch.tensor(float(step), dtype=_scalar_dtype())
    targets = {optimizer_tensor_name(n, slot): t for slot in OPTIMIZER_SLOTS
               for n, t in moment_targets(model, optimizer, slot).items()}
    body = file_body(path)
    moments, leftover = read_header_from(body, str(path))
    moments.check(rank, Layout(tp=tp), fix=f"resume with the checkpoint's {tp} ranks")
    fill_parameters(moments, body, targets, sha256=state["files"][name], leftover=leftover, verify="always")
    if scheduler is not None:
        if state["scheduler"] is None:
            raise CheckpointError(f"{source}: the checkpoint has no LR scheduler state, this run has one; resume "
                                  "without the schedule or from a checkpoint saved with it")
        scheduler.load_state_dict(state["scheduler"])
    for key, gen in (generators or {}).items():
        if key not in state["generators"]:
            raise CheckpointError(f"{source}: the checkpoint has no generator {key!r}; save it with this trainer")
        gen.set_state(decode_rng(state["generators"][key]))
    mine = state["rng"][rank]
    torch.set_rng_state(decode_rng(mine["torch"]))
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode_rng(mine["cuda"]))
    return {"step": step, "extra": dict(state["extra"])}


def start_step(
    state: Mapping[str, Any] | None, source: str | Path | None, model: nn.Module, optimizer: torch.optim.Optimizer,
    *, scheduler: Any | None = None, generators: Mapping[str, torch.Generator] | None = None, say: bool = True,
) -> int:
    """The step a run starts after: the checkpoint's (restored by `restore_training`) or 0. `source` is
    what `--resume` named (None without one); with `say`, one line tells what was resumed."""
    start = restore_training(state, source, model, optimizer, scheduler=scheduler,
                             generators=generators)["step"] if state is not None and source is not None else 0
    if say and source is not None:
        print(f"resumed from {source} at step {start}" if state is not None else
              f"{source}: weights only (no {STATE_NAME}): starting with a fresh optimizer at step 0", flush=True)
    return start


def _scalar_dtype() -> torch.dtype:
    """The dtype AdamW keeps its `step` in (torch.optim.optimizer._get_scalar_dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32

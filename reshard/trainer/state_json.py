"""`trainer_state.json`, the non-tensor half of a training checkpoint, in one place: encode, decode, check.

    version     "reshard.trainer_state/1" (`FORMAT`)
    step        optimizer steps taken (the run continues at step + 1)
    layout      {"tp": T} or {"fsdp": F, "tp": T}: the layout of its rank files (`Layout.from_obj`); dp
                replicas hold the same files, so a run's dp is not part of it
    files       relative path of every rank file of the checkpoint -> its sha256 (the parameters' files,
                then the optimizer's in `optimizer/`); a loader checks each is there and hashes to it
    optimizer   {"type": "AdamW", "step": N}: the optimizer's own scalar state
    scheduler   the LR scheduler's `state_dict()` (JSON values), or null
    generators  global generators (the same on every rank, e.g. the data order): name -> state (base64)
    rng         per rank of the layout, in rank order: {"torch": base64 of torch's default generator state,
                "cuda": ... when CUDA is used}
    extra       the training loop's own JSON state (seed, data cursor, ...)
    model       sha256 of the model's config.json and its tensors' names and global shapes
                (`model_fingerprint`): a resume checks the model its files build is this one
    relaid_from (only in a checkpoint `reshard write` re-laid out offline) a layout: the one it was
                saved at; its `rng` are then the states a resume at another layout reseeds to
                (`reshard.trainer.resume.reseed` of the saved seed, the step and the rank), so a resume
                from it equals one that cuts the original as it reads (`relaid_state`)

It is written last, by rank 0, so a directory without it (or whose files do not match it) is not a
checkpoint. No pickle: every value is JSON, generator states are their bytes in base64.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from reshard.errors import CheckpointError, PlanError
from reshard.format.rank_file import TRAINER_STATE_NAME
from reshard.layout.mesh import Layout

__all__ = ["FORMAT", "STATE_NAME", "check_state", "decode_rng", "encode_rng", "encode_state", "read_state",
           "model_fingerprint", "relaid_state", "rng_snapshot", "seeded_rng"]

FORMAT = "reshard.trainer_state/1"
STATE_NAME = TRAINER_STATE_NAME
_KEYS = ("step", "layout", "files", "optimizer", "rng", "generators", "extra")


def encode_rng(state: torch.Tensor) -> str:
    """A generator's state (a uint8 tensor) as base64 text."""
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    """The uint8 tensor `encode_rng` encoded."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_snapshot() -> dict[str, str]:
    """This process's default generators (CPU, and CUDA's current device when it is used)."""
    out = {"torch": encode_rng(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = encode_rng(torch.cuda.get_rng_state())
    return out


def encode_state(
    *, step: int, layout: Layout, files: Mapping[str, str], optimizer: str, scheduler: Mapping[str, Any] | None,
    generators: Mapping[str, torch.Generator], rng: list[dict[str, str]], extra: Mapping[str, Any],
    model: str | None = None,
) -> dict[str, Any]:
    """The trainer state (the module docstring) as JSON values, checked."""
    state = {
        "version": FORMAT, "step": step, "layout": layout.given(), "files": dict(sorted(files.items())),
        "optimizer": {"type": optimizer, "step": step},
        "scheduler": dict(scheduler) if scheduler is not None else None,
        "generators": {k: encode_rng(g.get_state()) for k, g in generators.items()},
        "rng": list(rng), "extra": dict(extra), **({"model": model} if model else {}),
    }
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"trainer state at step {step}: not JSON ({e}); keep the scheduler's and the "
                              "loop's state to JSON values") from None
    return check_state(state, "trainer state")


def check_state(state: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`state` checked against the format (`CheckpointError` naming `where` and what is wrong)."""
    if not isinstance(state, dict) or state.get("version") != FORMAT:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{where}: not a reshard trainer state (version {got!r}, expected {FORMAT!r})")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{where}: trainer state lacks {missing}; save the checkpoint again")
    try:
        world = Layout.from_obj(state["layout"], where=f"{where}: `layout`").world
    except PlanError as e:
        raise CheckpointError(f"{e}; save the checkpoint again") from None
    if not isinstance(state["rng"], list) or len(state["rng"]) != world:
        raise CheckpointError(f"{where}: trainer state has {len(state['rng']) if isinstance(state['rng'], list) else 'no'} "
                              f"rng entries for a layout of {world} ranks; save the checkpoint again")
    return dict(state)


def model_fingerprint(config: Mapping[str, Any] | None, tensors: Mapping[str, Mapping[str, Any]]) -> str:
    """sha256 (hex) of a model's config and its tensors' names and global shapes (whatever the layout and
    the dtype it is trained or stored in)."""
    config = {k: v for k, v in (config or {}).items() if k not in ("dtype", "torch_dtype")}
    what = {"config": config, "tensors": {n: list(d["shape"]) for n, d in tensors.items()}}
    return hashlib.sha256(json.dumps(what, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_state(directory: Path) -> dict[str, Any] | None:
    """The checked trainer state of a checkpoint directory, None when there is none (weights only)."""
    path = Path(directory) / STATE_NAME
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable trainer state ({e}); resume from an earlier checkpoint") from None
    state = check_state(state, str(path))
    absent = [name for name in state["files"] if not (path.parent / name).is_file()]
    if absent:
        raise CheckpointError(f"{path.parent}: incomplete checkpoint, {absent[:3]} missing; resume from an "
                              "earlier checkpoint")
    return state


def seeded_rng(seed: int) -> dict[str, str]:
    """A rank's `rng` entry as `torch.manual_seed(seed)` leaves torch's CPU generator (computed offline)."""
    return {"torch": encode_rng(torch.Generator().manual_seed(seed).get_state())}


def relaid_state(
    state: Mapping[str, Any], *, layout: Layout, files: Mapping[str, str], rng: list[dict[str, str]],
) -> dict[str, Any]:
    """The trainer state of checkpoint `state` re-laid out at `layout`: step, optimizer, scheduler,
    generators and extra kept; `layout`, `files` (relative path -> sha256) and the per-rank `rng` (the
    reseeded states, one per rank: `seeded_rng`) replaced; `relaid_from` records the layout it was saved at."""
    out = {**state, "layout": layout.given(), "files": dict(sorted(files.items())), "rng": list(rng),
           "relaid_from": dict(state.get("relaid_from") or state["layout"])}
    return check_state(out, f"trainer state re-laid at {layout.describe()}")

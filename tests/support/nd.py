"""The transformers side of the layout tests: checkpoints loaded with `DistributedConfig(...)` n-D meshes.

`load_nd(rank, world_size, jobs)` runs on each gloo rank (`tests/support/dist.py`). For each job (a
dict: name, ckpt, sizes for `DistributedConfig`, out prefix, and optionally the service URL of the
checkpoint and its /metrics URL) it loads the checkpoint as transformers does with that config, saves
this rank's local tensors (`DTensor.to_local()`, plain tensors as they are) to
`{out}-rank{rank}.safetensors` and, with a URL, zeroes every parameter and persistent buffer, refills
the model with `reshard.fill_model` from the service (one rank at a time, counting the bytes the
service sent it on its /metrics) and compares its logits and every local tensor with transformers'
own load. A job with `refuse` first offers the model shards it must refuse with `follow="shard"` (another
layout's, one with a tensor's FSDP chunk moved) and checks that nothing was copied. It returns, per job, the error
transformers raised on this rank (its first line; for a failed weight conversion, the conversion's
own error instead), or what the fill found. A rank whose peer failed to load skips the fill (the ranks
agree by an all-reduce first). A `native` job parallelizes with torch's own FSDP2 (`_native_fsdp`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from typing import Any

IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]
_SERVED = re.compile(r"^reshard_shard_bytes_served_total(?:\{[^}]*\})?\s+([0-9.e+]+)\s*$", re.M)
_CAUSE = re.compile(r"^(\w+(?:Error|Exception): .+)$", re.M)


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits.float().clone()


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_state(model: Any) -> dict[str, Any]:
    """Every parameter and persistent buffer of this rank, as it holds it locally (copies)."""
    return {k: _local(v).detach().clone().contiguous() for k, v in model.state_dict().items()}


def _unchanged(model: Any, saved: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(_local(v), saved[k]) for k, v in model.state_dict().items())


def _served(metrics: str) -> float:
    with urllib.request.urlopen(metrics, timeout=30) as r:
        return sum(float(x) for x in _SERVED.findall(r.read().decode()))


def _in_turn(fill: Callable[[], Any], metrics: str) -> tuple[Any, float]:
    """`fill()` on each rank in turn (barriers between), with the shard bytes the service sent meanwhile;
    an error is returned, not raised (the other ranks go on to the same collectives)."""
    import torch.distributed as dist

    rank, report, served = dist.get_rank(), None, -1.0
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == rank:
            before = _served(metrics)
            try:
                report = fill()
            except Exception as e:
                report = e
            served = _served(metrics) - before
    dist.barrier()
    return report, served


def _fill_and_compare(model: Any, job: dict[str, Any], saved: dict[str, Any], **fill: Any) -> dict[str, Any]:
    import torch

    import reshard

    want = _logits(model)
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():  # parameters and persistent buffers
            _local(t).zero_()
    zeroed = float((_logits(model) - want).abs().max())
    report, served = _in_turn(lambda: reshard.fill_model(model, job["url"], **fill), job["metrics"])
    got = _logits(model)
    found = {"zeroed_diff": zeroed, "diff": float((got - want).abs().max()), "served": served,
             "filled_equal": _unchanged(model, saved)}
    if isinstance(report, Exception):
        return {**found, "fill_error": f"{type(report).__name__}: {report}"}
    return {**found, "layout": report.layout.describe() if report.layout is not None else ""}


def _refusals(model: Any, refuse: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
    """Each shard of `refuse` offered to `model`: the error, and whether every local tensor is unchanged."""
    import reshard

    out: dict[str, Any] = {}
    for what, source in refuse.items():
        try:
            reshard.fill_model(model, source, follow="shard")  # the default would read what the model holds
            out[what] = "filled"
        except Exception as e:
            out[what] = f"{type(e).__name__}: {e}"
        out[f"{what}_unchanged"] = _unchanged(model, saved)
    return out


def _native_fsdp(job: dict[str, Any], world_size: int) -> dict[str, Any]:
    """A model parallelized by torch alone: FSDP2's `fully_shard` on every decoder layer and the root over a
    1-D mesh (no DistributedConfig); refilled with `fill_model(..., layout=Layout(fsdp=world_size))`."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import reshard

    model = AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype=torch.float32)
    want = _logits(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    found = _fill_and_compare(model, job, local_state(model), layout=reshard.Layout(fsdp=world_size))
    found["unsharded_diff"] = float((_logits(model) - want).abs().max())
    return found


@contextlib.contextmanager
def _load_reports() -> Iterator[list[str]]:
    """transformers' load reports (warnings) while loading, collected instead of printed."""
    import transformers

    lib = logging.getLogger("transformers")
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    level = lib.level
    transformers.logging.disable_default_handler()
    lib.addHandler(handler)
    lib.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        lib.removeHandler(handler)
        lib.setLevel(level)
        transformers.logging.enable_default_handler()


def _load(job: dict[str, Any]) -> tuple[Any, str | None]:
    """(the model, None) or (None, the error's first line [the weight conversion's own error])."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    with _load_reports() as reports:
        try:
            config = DistributedConfig(**job["sizes"])
            return AutoModelForCausalLM.from_pretrained(job["ckpt"], distributed_config=config, dtype=torch.float32), None
        except Exception as e:  # transformers cannot load this combination: the test says which error
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            causes = [m for text in reports for m in _CAUSE.findall(text)]  # the report names the conversion's error
            return None, f"{causes[-1]} (converting the weights)" if "conversion" in error and causes else error


def _any_failed(failed: bool) -> bool:
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(failed)])
    dist.all_reduce(flag)
    return bool(flag.item())


def load_nd(rank: int, world_size: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    warnings.simplefilter("ignore")
    import transformers
    from safetensors.torch import save_file

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    found: dict[str, Any] = {}
    for job in jobs:
        if job.get("native"):
            found[job["name"]] = _native_fsdp(job, world_size)
            continue
        model, error = _load(job)
        peer_failed = _any_failed(error is not None)  # every rank, every job: the ranks agree
        if model is None:
            found[job["name"]] = {"error": error}
            continue
        saved = local_state(model)
        save_file(saved, f"{job['out']}-rank{rank}.safetensors")
        result: dict[str, Any] = {"peer_failed": peer_failed}
        if not peer_failed and job.get("refuse"):
            result.update(_refusals(model, job["refuse"], saved))
        if not peer_failed and job.get("url"):
            result.update(_fill_and_compare(model, job, saved))
        found[job["name"]] = result
    return found

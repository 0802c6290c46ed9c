"""The transformers side of the layout tests: checkpoints loaded with `DistributedConfig(...)` n-D meshes.

`load_nd(rank, world_size, jobs)` runs on each gloo rank (`tests/support/dist.py`). For each job (a
dict: name, ckpt, sizes for `DistributedConfig`, out prefix, and optionally the service URL of the
checkpoint) it loads the checkpoint as transformers does with that config, saves this rank's local
tensors (`DTensor.to_local()`, plain tensors as they are) to `{out}-rank{rank}.safetensors` and, with a
URL, zeroes every parameter, refills the model with `reshard.fill_model` from the service and compares
its logits with transformers' own load. It returns, per job, the error transformers raised (its first
line), or what the fill found (logit difference before and after, bytes pulled). A `native` job
parallelizes with torch's own FSDP2 instead (`_native_fsdp`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits.float().clone()


def _fill_and_compare(model: Any, url: str, **fill: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    import reshard

    want = _logits(model)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()
    zeroed = float((_logits(model) - want).abs().max())
    report = reshard.fill_model(model, url, **fill)
    got = _logits(model)
    return {"zeroed_diff": zeroed, "diff": float((got - want).abs().max()), "bytes": report.bytes,
            "layout": report.layout.describe() if report.layout is not None else ""}


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
    found = _fill_and_compare(model, job["url"], layout=reshard.Layout(fsdp=world_size))
    found["unsharded_diff"] = float((_logits(model) - want).abs().max())
    return found


def load_nd(rank: int, world_size: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    warnings.simplefilter("ignore")
    import torch
    import transformers
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    found: dict[str, Any] = {}
    for job in jobs:
        if job.get("native"):
            found[job["name"]] = _native_fsdp(job, world_size)
            continue
        try:
            config = DistributedConfig(**job["sizes"])
            model = AutoModelForCausalLM.from_pretrained(job["ckpt"], distributed_config=config, dtype=torch.float32)
        except Exception as e:  # transformers cannot load this combination: the test says which error
            found[job["name"]] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            continue
        local = {}
        for key, value in model.state_dict().items():
            t = value.to_local() if isinstance(value, DTensor) else value
            local[key] = t.detach().clone().contiguous()
        save_file(local, f"{job['out']}-rank{rank}.safetensors")
        found[job["name"]] = _fill_and_compare(model, job["url"]) if job.get("url") else {}
    return found

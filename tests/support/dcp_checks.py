"""The gloo ranks of the DCP reader tests (`tests/integrations/test_dcp_reader.py`, through tests/support/dist.py).

`load_transformers(rank, world, jobs)`: per job, transformers' model of the checkpoint built on the meta
device and parallelized as `DistributedConfig(**sizes)` makes it (FSDP2 x TP: DTensor parameters, strided
shards among them), materialized and zeroed, then filled by `dcp.load(model.state_dict(),
storage_reader=ReshardReader(url))`. `load_native(rank, world, job)`: a torch-only module (an embedding, a
column- and a row-parallel Linear with biases, a norm) parallelized with `parallelize_module` over the tp
dim of a (dp, tp) mesh and, when dp > 1, `fully_shard` over the dp dim. Both return, per job, the names
whose full tensor (`full_tensor()`) differs from the reference, the placements seen, the bytes the rank's
DTensors hold locally (at the checkpoint's dtypes) and the bytes of the answer the reader received.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["load_native", "load_transformers", "native_state"]

NATIVE = {"embed.weight": (64, 16), "up.weight": (48, 16), "up.bias": (48,), "down.weight": (16, 48),
          "down.bias": (16,), "norm": (16,)}


def _findings(state: dict[str, Any], reference: dict[str, Any], dtypes: dict[str, Any], reader: Any) -> dict[str, Any]:
    """What a filled state dict says (every rank calls: `full_tensor` is a collective, in one order)."""
    import torch
    from torch.distributed.tensor import DTensor

    wrong, placements, held = [], set(), 0
    for name in sorted(state):
        t = state[name]
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(t, DTensor):
            placements.add(str(tuple(t.placements)))
        held += local.numel() * torch.empty((), dtype=dtypes[name]).element_size()
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if not torch.equal(full, reference[name].to(full.dtype)):
            wrong.append(name)
    return {"wrong": wrong, "placements": sorted(placements), "held": held, "received": reader.bytes_read,
            "names": len(state)}


def _env(rank: int, world: int) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    warnings.simplefilter("ignore")


def load_transformers(rank: int, world: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers
    from transformers.distributed import DistributedConfig

    from reshard.fill.empty_model import hf_config, meta_model
    from reshard.format.torch_side import TORCH_DTYPES
    from reshard.integrations.dcp import ReshardReader

    _env(rank, world)
    transformers.logging.set_verbosity_error()
    found: dict[str, Any] = {}
    for job in jobs:
        config = json.loads((Path(job["ckpt"]) / "config.json").read_text())
        model = meta_model(hf_config(config), dtype=torch.float32)
        cls = type(model)
        distributed, _, mesh = cls.prepare_distribute_model(DistributedConfig(**job["sizes"]))
        model = cls.maybe_distribute_model(model, distributed, mesh)
        model.to_empty(device="cpu")
        state = model.state_dict()
        with torch.no_grad():
            for t in state.values():
                (t.to_local() if hasattr(t, "to_local") else t).zero_()
        reader = ReshardReader(job["url"])
        dcp.load(state, storage_reader=reader)
        reference = transformers.AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype=torch.float32).state_dict()
        on_disk = {n: s.dtype for n, s in reader.stored.items()}
        found[job["name"]] = _findings(state, reference, {n: TORCH_DTYPES[on_disk[n]] for n in state}, reader)
    return found


def native_state(seed: int) -> dict[str, Any]:
    """The reference tensors of the torch-only module (what its checkpoint holds)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in NATIVE.items()}


def load_native(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from reshard.integrations.dcp import ReshardReader

    _env(rank, world)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(*NATIVE["embed.weight"])
            self.up = nn.Linear(16, 48)
            self.down = nn.Linear(48, 16)
            self.norm = nn.Parameter(torch.ones(16))

    dp, tp = job["dp"], world // job["dp"]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        net = Net()
    parallelize_module(net, mesh["tp"], {"embed": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(),
                                         "down": RowwiseParallel()})
    net.norm = nn.Parameter(distribute_tensor(torch.empty(16, device="meta"), mesh["tp"], [Shard(0)]))
    if dp > 1:
        fully_shard(net, mesh=mesh["dp"])
    net.to_empty(device="cpu")
    state = net.state_dict()
    with torch.no_grad():
        for t in state.values():
            t.to_local().zero_()
    reader = ReshardReader(job["source"], names="disk")
    dcp.load(state, storage_reader=reader)
    reference = native_state(job["seed"])
    return _findings(state, reference, {n: torch.bfloat16 for n in state}, reader)

"""DCP checkpoints made by torch and transformers themselves, for the DCP source tests (tests/io/source).

`hf_ckpt` is a small Qwen3 checkpoint whose hidden size is odd (65: head_dim is set apart), so FSDP2 over 2
ranks cuts o_proj, down_proj and the norms into uneven chunks (33 + 32 rows) while tp=2 still splits
every tensor evenly. The savers:

- `dcp_save` (one process): `dcp.save` of the model's state dict, or of `{"model": sd, "step": N}`;
- `hf_writer_save` (one process): `HuggingFaceStorageWriter(save_distributed=True)`;
- `save_fsdp_ranks` (each gloo rank): the model loaded by transformers with `DistributedConfig(fsdp_size=2)`,
  saved by `dcp.save(get_model_state_dict(model))` and by transformers' own `save_pretrained(...,
  distributed_checkpoint=True)`;
- `load_rank_files` (each gloo rank): rank files `reshard write` made, loaded by torch's
  `HuggingFaceStorageReader` into an FSDP2 model and into a `parallelize_module` TP model.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from reshard.testing.synth import llama_config, make_checkpoint

STEP = 7


class Payload:
    """A pickle that creates a directory when loaded: what `pickle.load` of a crafted `.metadata` would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (str(self.path),))


def hf_ckpt(path: Path, *, intermediate_size: int = 128, vocab_size: int = 256) -> Path:
    config = llama_config(model_type="qwen3", hidden_size=65, head_dim=16, intermediate_size=intermediate_size,
                          vocab_size=vocab_size, num_attention_heads=4, num_key_value_heads=2)
    return make_checkpoint(path, config, dtype=torch.float32, seed=5)


def _model(ckpt: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)


def _quiet() -> None:
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def dcp_save(ckpt: Path, out: Path, *, wrap: bool) -> Path:
    """`dcp.save` from one process: the model's state dict, or when `wrap` a training state around it
    (`{"model": sd, "optimizer": {"state": {NAME: {"exp_avg": ...}}}, "step": STEP}`, for two parameters)."""
    import torch.distributed.checkpoint as dcp

    _quiet()
    sd = _model(ckpt).state_dict()
    moments = {n: {"exp_avg": torch.full_like(sd[n], 0.5)} for n in ("lm_head.weight", "model.norm.weight")}
    dcp.save({"model": sd, "optimizer": {"state": moments}, "step": STEP} if wrap else sd, checkpoint_id=str(out))
    shutil.copy(ckpt / "config.json", out / "config.json")
    return out


def hf_writer_save(ckpt: Path, out: Path) -> Path:
    """`HuggingFaceStorageWriter(save_distributed=True)` from one process: one shard file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    _quiet()
    dcp.save(_model(ckpt).state_dict(), storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True))
    shutil.copy(ckpt / "config.json", out / "config.json")
    return out


def save_fsdp_ranks(rank: int, world_size: int, ckpt: str, dcp_dir: str, hf_dir: str) -> dict[str, list[int]]:
    """The model loaded by transformers with FSDP2 over the ranks, saved both ways; returns this rank's
    local shape of each tensor."""
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    _quiet()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=DistributedConfig(fsdp_size=world_size),
                                                 dtype=torch.float32)
    sd = get_model_state_dict(model)
    dcp.save(sd, checkpoint_id=dcp_dir)
    model.save_pretrained(hf_dir, distributed_checkpoint=True)
    return {n: list(getattr(t, "_local_tensor", t).shape) for n, t in sd.items()}


def load_rank_files(rank: int, world_size: int, ckpt: str, shards: str) -> dict[str, Any]:
    """Rank files loaded by torch alone (`dcp.load` + `HuggingFaceStorageReader`) into FSDP2 and TP models:
    per model, the tensors whose full value differs from the checkpoint's, and the tensors loaded."""
    _quiet()
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoConfig, AutoModelForCausalLM

    want = load_file(f"{ckpt}/model.safetensors")
    mesh = init_device_mesh("cpu", (world_size,))
    found: dict[str, Any] = {}
    for how in ("fsdp", "tp"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
        if how == "fsdp":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            plan = {f"model.layers.{i}.{m}": style for i in range(len(model.model.layers)) for m, style in (
                ("self_attn.q_proj", ColwiseParallel()), ("self_attn.k_proj", ColwiseParallel()),
                ("self_attn.v_proj", ColwiseParallel()), ("self_attn.o_proj", RowwiseParallel()),
                ("mlp.gate_proj", ColwiseParallel()), ("mlp.up_proj", ColwiseParallel()),
                ("mlp.down_proj", RowwiseParallel()))}
            parallelize_module(model, mesh, {**plan, "lm_head": ColwiseParallel()})
        model.to_empty(device="cpu")
        sd = model.state_dict()
        for t in sd.values():
            (t._local_tensor if isinstance(t, DTensor) else t).fill_(float("nan"))
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(shards))
        full = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in sd.items()}
        found[how] = {"differ": sorted(n for n in want if not torch.equal(full[n], want[n])),
                      "loaded": sorted(full), "sharded": sorted(n for n, t in sd.items() if isinstance(t, DTensor))}
    return found

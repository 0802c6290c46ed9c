"""MXFP4 and NVFP4 shards from a real `reshard serve`, `fill_model` into a consumer that holds the packed
tensors (vLLM's way: uint8 blocks, FP8 scales, as stored), and the refusals where the packed bytes would
land in a dequantized parameter."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import PlanError
from reshard.format.rank_file import rank_file_name
from reshard.testing.synth import llama_config
from tests.support.dist import run_distributed
from tests.support.fill_checks import Holder
from tests.support.fp4_ckpt import GPT_OSS, MX_BLOCK, gpt_oss_mxfp4, nvfp4_checkpoint
from tests.support.live import live_server

E, HIDDEN, INTER = GPT_OSS["num_local_experts"], GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"]


def write(src: Path, out: Path, *args: str) -> Path:
    from reshard.cli import main

    assert main(["write", str(src), "-o", str(out), "--no-progress", *args]) == 0
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fp4_serve") / "root"
    gpt_oss_mxfp4(base / "mx", seed=1)
    nvfp4_checkpoint(base / "nv", llama_config(), flavour="ct", seed=2)
    return base


@pytest.mark.servers
def test_service_streams_fp4_shards_byte_identical_to_write(root: Path, tmp_path: Path) -> None:
    cases = {("mx", 2, "vllm"): write(root / "mx", tmp_path / "mx", "--tp", "2", "--engine", "vllm"),
             ("nv", 4, None): write(root / "nv", tmp_path / "nv", "--tp", "4")}
    with live_server(root, log_dir=tmp_path, chunk_size=64 << 10) as srv:
        for (case, tp, engine), out in cases.items():
            params: dict[str, Any] = {"tp": tp, **({"engine": engine} if engine else {})}
            for rank in range(tp):
                r = httpx.get(f"{srv.ckpt_url(case)}/shards/{rank}", params=params, timeout=60)
                assert r.status_code == 200, r.text
                assert r.content == (out / rank_file_name(rank, tp)).read_bytes(), (case, rank)
        bad = httpx.get(f"{srv.ckpt_url('mx')}/shards/0", params={"tp": 8, "engine": "vllm"}, timeout=60)
        assert bad.status_code == 422 and bad.json()["error"] == "PlanError"
        assert "inside one MXFP4 block of 32 FP4 values" in bad.json()["detail"]
        assert "Traceback" not in srv.log()


def mx_rank_shapes(full: dict[str, torch.Tensor], tp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What vLLM's GptOssMxfp4MoEMethod.create_weights and GptOssAttention allocate per rank (tp at most the kv
    heads), in checkpoint names and layout: gate_up's rows and down's K divided by tp, the vocabulary (256: a
    multiple of 64), q/k/v's heads and the sinks too, o_proj's input; the rest whole."""
    out = {}
    for name, t in full.items():
        shape = list(t.shape)
        if ".experts.gate_up_proj_" in name:
            shape[1] //= tp
        elif ".experts.down_proj_" in name and not name.endswith("_bias"):
            shape[2] //= tp
        elif name in ("model.embed_tokens.weight", "lm_head.weight") or name.endswith(".sinks") \
                or re.search(r"\.self_attn\.[qkv]_proj\.", name):
            shape[0] //= tp
        elif name.endswith(".self_attn.o_proj.weight"):
            shape[1] //= tp
        out[name] = (tuple(shape), t.dtype)
    return out


def _fill_job(rank: int, world: int, src: str, out: str) -> dict[str, Any]:
    from reshard.fill.model import fill_model

    full = load_file(str(Path(src) / "model.safetensors"))
    shapes = mx_rank_shapes(full, world)
    model = Holder(shapes)
    fill_model(model, out)
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrong = Holder({**shapes, "model.layers.0.mlp.experts.down_proj_scales": (
        shapes["model.layers.0.mlp.experts.down_proj_scales"][0], torch.float32)})
    try:
        fill_model(wrong, out)
        refused = ""
    except PlanError as e:
        refused = str(e)
    return {"got": got, "refused": refused}


@pytest.mark.multiproc
def test_fill_model_into_packed_parameters(root: Path, tmp_path: Path) -> None:
    """Two gloo ranks fill vLLM-shaped packed parameters from `reshard write --engine vllm` shards: each
    gets the checkpoint's bytes of its rows / K blocks; a float32 parameter for a packed scale is refused."""
    out = write(root / "mx", tmp_path / "tp2", "--tp", "2", "--engine", "vllm")
    full = load_file(str(root / "mx" / "model.safetensors"))
    ranks = run_distributed(_fill_job, 2, str(root / "mx"), str(out), timeout=300)
    for r, res in enumerate(ranks):
        got = res["got"]
        rows, inter = torch.arange(2 * INTER).chunk(2)[r], torch.arange(INTER).chunk(2)[r]
        kb = torch.unique(inter // MX_BLOCK)
        for layer in range(GPT_OSS["num_hidden_layers"]):
            pre = f"model.layers.{layer}.mlp.experts."
            assert torch.equal(got[pre + "gate_up_proj_blocks"], full[pre + "gate_up_proj_blocks"][:, rows])
            assert torch.equal(got[pre + "gate_up_proj_scales"], full[pre + "gate_up_proj_scales"][:, rows])
            assert torch.equal(got[pre + "gate_up_proj_bias"], full[pre + "gate_up_proj_bias"][:, rows])
            assert torch.equal(got[pre + "down_proj_blocks"], full[pre + "down_proj_blocks"][:, :, kb])
            assert torch.equal(got[pre + "down_proj_scales"], full[pre + "down_proj_scales"][:, :, kb])
            assert torch.equal(got[pre + "down_proj_bias"], full[pre + "down_proj_bias"])
        assert "down_proj_scales: MXFP4" in res["refused"] and "into a float32 parameter" in res["refused"]


@pytest.mark.pure
def test_the_trainer_refuses_packed_4bit_shards(root: Path, tmp_path: Path) -> None:
    from reshard.trainer import build_model

    out = write(root / "nv", tmp_path / "tp1", "--tp", "1")
    with pytest.raises(PlanError, match=r"weight_packed: NVFP4 \(compressed-tensors .* cannot dequantize them"):
        build_model(out, dtype=torch.float32)

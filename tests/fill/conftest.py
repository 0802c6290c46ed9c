"""Fixtures for the fill_model tests: transformers-made checkpoints (dense llama, MoE qwen3_moe) under one
root, a real `reshard serve` on it, and the shard directories and broken files the bad-input checks use."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.fill_checks import SMALL
from tests.support.live import LiveServer, live_server

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "intermediate_size": 128, "dtype": "float32", **SMALL},
    # bfloat16 on disk, filled into float32 parameters: the report lists the casts
    "moe": {"model_type": "qwen3_moe", "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
            "dtype": "bfloat16", **SMALL},
}
# what transformers' TP does for qwen3_moe, per expert (reshard has no built-in plan for it yet)
MOE_RULES = """\
rules:
  - {pattern: "model.layers.*.self_attn.[qkv]_proj.weight", kind: column}
  - {pattern: "model.layers.*.self_attn.o_proj.weight", kind: row}
  - {pattern: "model.layers.*.mlp.experts.*.gate_proj.weight", kind: column}
  - {pattern: "model.layers.*.mlp.experts.*.up_proj.weight", kind: column}
  - {pattern: "model.layers.*.mlp.experts.*.down_proj.weight", kind: row}
  - {pattern: model.embed_tokens.weight, kind: vocab_embed}
  - {pattern: lm_head.weight, kind: column}
"""


def _save(path: Path, config: dict[str, Any], seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "dtype"})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, config["dtype"]))
    with torch.no_grad():  # the default init leaves biases/norms at 0/1; make every tensor distinct
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def save_hf_ckpt() -> Any:
    """`save_hf_ckpt(path, config_dict, seed)`: a transformers-made checkpoint with random weights."""
    return _save


@pytest.fixture(scope="session")
def fill_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fill") / "root"
    for seed, (name, config) in enumerate(CONFIGS.items()):
        _save(root / name, config, seed)
    (root / "moe" / "reshard-rules.yaml").write_text(MOE_RULES)
    return root


@pytest.fixture(scope="session")
def fill_server(fill_root: Path) -> Iterator[LiveServer]:
    with live_server(fill_root) as srv:
        yield srv


@pytest.fixture(scope="session")
def llama_shards(fill_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`reshard write` of the llama checkpoint at tp=2 and tp=4, and a truncated copy of rank 0 of 2."""
    from reshard.cli import main

    out = tmp_path_factory.mktemp("fill-shards")
    dirs = {}
    for tp in (1, 2, 4):
        dirs[f"tp{tp}"] = out / f"tp{tp}"
        assert main(["write", str(fill_root / "llama"), "--tp", str(tp), "-o", str(dirs[f"tp{tp}"])]) == 0
    bad = out / "truncated"
    bad.mkdir()
    src = dirs["tp2"] / "rank-00000-of-00002.safetensors"
    data = src.read_bytes()
    (bad / src.name).write_bytes(data[: len(data) * 3 // 5])
    shutil.copy(dirs["tp2"] / "config.json", bad / "config.json")
    dirs["truncated"] = bad / src.name
    return dirs

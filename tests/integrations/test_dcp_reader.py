"""torch DCP through `ReshardReader`: `dcp.load(model.state_dict(), storage_reader=ReshardReader(...))` fills
DTensor models with the checkpoint's values, each rank receiving only the blocks its placements hold.

- transformers' models (a dense llama, a qwen3_moe whose experts transformers fuses) on 4 gloo ranks,
  FSDP2 x TP (`DistributedConfig(fsdp_size=2, tp_size=2)`: strided shards among the placements), from the
  service: every full tensor equals transformers' own load of the checkpoint, and each rank's answer is its
  local bytes plus a small header, the server's count of bytes sent the sum of the ranks';
- a torch-only module parallelized with `parallelize_module` (and `fully_shard` over it), from rank files
  of another layout read here;
- single process: the metadata names (disk, renamed, fused, tied), and what is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from reshard.cli import main
from reshard.errors import CheckpointError
from tests.support.dcp_checks import NATIVE, load_native, load_transformers, native_state
from tests.support.dist import run_distributed
from tests.support.live import live_server, metric

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8}
CONFIGS = {
    "llama": {"model_type": "llama", "intermediate_size": 64, **SMALL},
    "moe": {"model_type": "qwen3_moe", "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], **SMALL},
}
HEADER_MAX = 64 << 10  # the answer's safetensors header, at most


def _save(path: Path, config: dict[str, Any], seed: int, dtype: torch.dtype) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dcp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp") / "root"
    _save(root / "llama", CONFIGS["llama"], 1, torch.float32)
    _save(root / "moe", CONFIGS["moe"], 2, torch.bfloat16)  # bfloat16 on disk, float32 parameters
    return root


@pytest.mark.servers
def test_fsdp_x_tp_transformers_models_from_the_service(dcp_root: Path, tmp_path: Path) -> None:
    with live_server(dcp_root, log_dir=tmp_path) as srv:
        jobs = [{"name": n, "ckpt": str(dcp_root / n), "url": srv.ckpt_url(n), "sizes": {"fsdp_size": 2, "tp_size": 2}}
                for n in CONFIGS]
        before = metric(srv, "reshard_shard_bytes_served_total")
        found = run_distributed(load_transformers, 4, jobs, timeout=600)
        served = metric(srv, "reshard_shard_bytes_served_total") - before
        assert "Traceback" not in srv.log(), srv.log()
    for name in CONFIGS:
        per_rank = [f[name] for f in found]
        assert all(r["wrong"] == [] for r in per_rank), (name, [r["wrong"] for r in per_rank])
        placements = set().union(*(r["placements"] for r in per_rank))
        assert any("_StridedShard" in p for p in placements) and any("Shard(dim=1)" in p for p in placements), placements
        for r in per_rank:  # each rank received what it holds, and a header
            assert r["held"] < r["received"] <= r["held"] + HEADER_MAX, (name, r)
        total = sum(f.stat().st_size for f in (dcp_root / name).glob("*.safetensors"))
        assert max(r["held"] for r in per_rank) < total / 2
    assert served == sum(f[n]["received"] for f in found for n in CONFIGS)


@pytest.mark.multiproc
@pytest.mark.parametrize("dp", [1, 2], ids=["tp4", "dp2xtp2"])
def test_a_parallelize_module_model_from_rank_files(tmp_path: Path, dp: int) -> None:
    """The checkpoint's tensors as rank files of tp=2 (column/row rules): the reader plans each rank's boxes
    across their pieces; the model is split otherwise (tp=4, or FSDP2 over tp=2 with strided shards)."""
    src = tmp_path / "native"
    src.mkdir()
    save_file(native_state(5), str(src / "model.safetensors"))
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {pattern: up.*, kind: column}\n  - {pattern: down.weight, kind: row}\n"
                     "  - {pattern: embed.weight, kind: vocab_embed}\n")
    assert main(["write", str(src), "--tp", "2", "--rules", str(rules), "-o", str(tmp_path / "ranks"),
                 "--no-progress"]) == 0
    found = run_distributed(load_native, 4, {"source": str(tmp_path / "ranks"), "dp": dp, "seed": 5}, timeout=300)
    assert all(r["wrong"] == [] for r in found), [r["wrong"] for r in found]
    assert all(r["names"] == len(NATIVE) for r in found)
    if dp > 1:
        assert any("_StridedShard" in p for r in found for p in r["placements"])
    for r in found:
        assert r["held"] < r["received"] <= r["held"] + HEADER_MAX, r
    # every element on exactly one rank, but the row-parallel bias, which each of the tp ranks holds
    whole, bias = sum(t.numel() * 2 for t in native_state(5).values()), NATIVE["down.bias"][0] * 2
    assert sum(r["held"] for r in found) == whole + (4 // dp - 1) * bias


@pytest.mark.pure
def test_the_metadata_names_disk_renamed_fused_and_tied(dcp_root: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from reshard.integrations.dcp import ReshardReader

    reader = ReshardReader(dcp_root / "moe")
    meta = reader.read_metadata()
    names = meta.state_dict_metadata
    fused = names["model.layers.1.mlp.experts.gate_up_proj"]
    assert (list(fused.size), fused.properties.dtype) == ([4, 32, 32], torch.bfloat16)
    assert list(names["model.layers.1.mlp.experts.3.up_proj.weight"].size) == [16, 32]  # the names on disk too
    # a tied head: the embedding under the head's name as well
    tied = _save(tmp_path / "tied", {**CONFIGS["llama"], "tie_word_embeddings": True}, 3, torch.float32)
    assert "lm_head.weight" in ReshardReader(tied).read_metadata().state_dict_metadata
    assert "lm_head.weight" not in ReshardReader(tied, names="disk").read_metadata().state_dict_metadata
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        **{**CONFIGS["llama"], "tie_word_embeddings": True}))
    dcp.load(model.state_dict(), storage_reader=ReshardReader(tied), no_dist=True)
    want = transformers.AutoModelForCausalLM.from_pretrained(tied).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    # a state dict that asks for what the checkpoint does not hold: DCP's own error, nothing else read
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: extra"):
        dcp.load({"extra": torch.zeros(3)}, storage_reader=ReshardReader(tied), no_dist=True)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ReshardReader(tmp_path / "nowhere").read_metadata()
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True

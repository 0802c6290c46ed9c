"""`reshard.fill_model` on real TP models: transformers' own `tp_plan="auto"` (dense and MoE) and torch's
`parallelize_module`, filled from a running `reshard serve` under 2 gloo ranks, against transformers'
`from_pretrained` on the full checkpoint; bad input (another tp or rank, a layout that disagrees, a
truncated stream); and, in one process, a plain model and the expert mapping."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors import safe_open

import reshard
from reshard.errors import PlanError
from reshard.fill.experts import expert_views, shard_layout
from reshard.rules.tp_plans.entry import table_version
from tests.support.fill_checks import SMALL, hf_tp_job, ids_for, run_distributed, torch_tp_job

transformers = pytest.importorskip("transformers")

TP = 2
EXACT = 1e-6  # the same kernels on the same local shards: equal up to float noise
UNSHARDED = 2e-5  # vs one process: the sums are split across ranks


def _case(root: Path, server: Any, name: str, dtype: str) -> dict[str, Any]:
    vocab = json.loads((root / name / "config.json").read_text())["vocab_size"]
    return {"path": str(root / name), "url": server.ckpt_url(name), "dtype": dtype, "vocab": vocab}


def _header_len(server: Any, name: str, rank: int) -> int:
    r = httpx.get(f"{server.ckpt_url(name)}/shards/{rank}", params={"tp": TP}, headers={"Range": "bytes=0-7"})
    return 8 + int.from_bytes(r.content, "little")


def _fused_name(name: str) -> str:
    """transformers' fused parameter for a per-expert checkpoint tensor (itself for the others)."""
    name = re.sub(r"(\.experts)\.\d+\.(gate|up)_proj\.weight$", r"\1.gate_up_proj", name)
    return re.sub(r"(\.experts)\.\d+\.down_proj\.weight$", r"\1.down_proj", name)


@pytest.fixture(scope="module")
def hf_results(fill_root: Path, fill_server: Any) -> list[dict[str, Any]]:
    cases = {"llama": _case(fill_root, fill_server, "llama", "float32"),
             "moe": _case(fill_root, fill_server, "moe", "float32")}
    return run_distributed(hf_tp_job, TP, cases, fill_server.url, timeout=300.0)


@pytest.mark.servers
@pytest.mark.parametrize("name", ["llama", "moe"])
def test_transformers_tp_logits_equal_from_pretrained(hf_results: list[dict[str, Any]], name: str) -> None:
    for rank in range(TP):
        r = hf_results[rank][name]
        assert r["finite"] and r["max_diff"] <= EXACT, (rank, r["max_diff"])
        assert r["dtensors"] == r["ref_dtensors"] > 0


@pytest.mark.servers
@pytest.mark.parametrize("name", ["llama", "moe"])
def test_each_rank_pulls_its_half(hf_results: list[dict[str, Any]], fill_root: Path, fill_server: Any,
                                  name: str) -> None:
    """Bytes served per rank (the service's /metrics) = the rank file; its data = half of every tensor
    transformers shards plus every tensor it replicates, read off the full checkpoint."""
    sharded = set(hf_results[0][name]["sharded"])
    full = replicated = 0
    with safe_open(str(fill_root / name / "model.safetensors"), "pt") as f:
        for key in f.keys():
            n = f.get_slice(key).get_shape()
            nbytes = torch.Size(n).numel() * {"F32": 4, "BF16": 2}[f.get_slice(key).get_dtype()]
            full += nbytes
            replicated += 0 if _fused_name(key) in sharded else nbytes
    for rank in range(TP):
        r = hf_results[rank][name]
        held = (full - replicated) // TP + replicated
        if r["followed"] == "model":  # the rank file was cut by another release's plan: the model's blocks, as boxes
            assert transformers.__version__ != table_version(), "under the table's release the shard is what it holds"
            assert r["served"] >= r["bytes"] and held < r["bytes"] <= held + (64 << 10), (rank, r)
            continue
        assert replicated < full / 4  # the test means something: most bytes are sharded
        assert r["served"] == r["bytes"], (rank, r)
        assert r["bytes"] - _header_len(fill_server, name, rank) == held


@pytest.mark.servers
def test_moe_experts_fill_fused_parameters_with_casts(hf_results: list[dict[str, Any]]) -> None:
    for rank in range(TP):
        moe, llama = hf_results[rank]["moe"], hf_results[rank]["llama"]
        # 2 layers x 4 experts x (gate, up, down) per-expert tensors land in 2 x 2 fused parameters
        assert moe["fused"] == 2 * 4 * 3
        # casts are counted per shard tensor, or per model tensor where the default followed the model (boxes)
        assert moe["casts"] == (moe["tensors"] if moe["followed"] == "shard" else moe["params"])
        assert moe["cast_kinds"] == [("bfloat16", "float32")]
        assert llama["casts"] == 0 and llama["fused"] == 0


@pytest.fixture(scope="module")
def torch_results(fill_root: Path, fill_server: Any, llama_shards: dict[str, Path]) -> list[dict[str, Any]]:
    case = _case(fill_root, fill_server, "llama", "float32")
    return run_distributed(torch_tp_job, TP, case, fill_server.url, str(llama_shards["tp4"]),
                           str(llama_shards["tp2"]), str(llama_shards["truncated"]), timeout=300.0)


@pytest.mark.servers
def test_parallelize_module_outputs_equal_unsharded(torch_results: list[dict[str, Any]],
                                                    llama_shards: dict[str, Path]) -> None:
    for rank in range(TP):
        r = torch_results[rank]
        assert r["max_diff"] <= UNSHARDED, (rank, r["max_diff"])
        size = (llama_shards["tp2"] / f"rank-{rank:05d}-of-00002.safetensors").stat().st_size
        assert r["served"] == r["bytes"] == size


@pytest.mark.servers
def test_wrong_tp_or_rank_is_refused_untouched_unless_followed(torch_results: list[dict[str, Any]]) -> None:
    for rank in range(TP):
        r = torch_results[rank]
        assert r["other_tp_dir"].startswith("CheckpointError") and "for tp=2" in r["other_tp_dir"] \
            and "worlds of [4] ranks" in r["other_tp_dir"], r["other_tp_dir"]
        assert f"rank {rank} of tp=4, but this process is rank {rank} of tp=2" in r["other_tp_file"], r["other_tp_file"]
        assert f"rank {1 - rank} of tp=2, but this process is rank {rank}" in r["other_rank_file"], r["other_rank_file"]
        assert r["untouched"]
        # the default follows the model: another layout's rank files give the blocks it holds, bit for bit
        assert r["other_tp_dir_auto"] == {"follow": "model", "equal": True}, r["other_tp_dir_auto"]


@pytest.mark.servers
def test_layout_mismatch_is_one_error_naming_both_layouts(torch_results: list[dict[str, Any]]) -> None:
    for rank in range(TP):
        r = torch_results[rank]
        swapped = r["swapped_q"]
        assert swapped.startswith("PlanError") and "nothing was filled" in swapped
        q = "model.layers.0.self_attn.q_proj.weight"
        assert re.search(rf"{re.escape(q)}: the model has shape \[64, 32\] \(DTensor \(Shard\(dim=1\),\).*dim 1 "
                         rf"{32 * rank}:{32 * rank + 32} of 64\), the shard has shape \[32, 64\] \(kind column.*dim 0 "
                         rf"{32 * rank}:{32 * rank + 32} of 64\)", swapped), swapped
        assert swapped.count("the model has shape") == 1  # only the one parameter
        # same local shapes, the other rank's halves: caught by the held indices, not the shapes
        rev = r["reversed_mesh"]
        other = 128 * (1 - rank)
        assert rev.split("nothing was filled: ")[1].startswith(
            f"lm_head.weight: the model has shape [128, 64] (DTensor (Shard(dim=0),) of global [256, 64] on a 2-rank "
            f"mesh, holding dim 0 {other}:{other + 128} of 256), the shard has shape [128, 64] (kind column"), rev
        assert "(and " in rev  # every split tensor disagrees; the first few are shown
        one = r["one_layer"]
        assert "in the shard but not in the model: model.layers.1." in one and "missing from the shard: none" in one
        assert r["swapped_q_untouched"] and r["reversed_mesh_untouched"] and r["one_layer_untouched"]


@pytest.mark.servers
def test_truncated_rank_file_is_refused_before_any_byte_lands(torch_results: list[dict[str, Any]]) -> None:
    r = torch_results[0]
    assert r["truncated"].startswith("IntegrityError") and "truncated or corrupt" in r["truncated"], r["truncated"]
    assert "nothing was read from it" in r["truncated"] and r["filled_before_cut"] == [], r


# --- one process --------------------------------------------------------------------------------

@pytest.mark.pure
def test_plain_model_from_a_directory_and_a_rank_file(fill_root: Path, llama_shards: dict[str, Path]) -> None:
    """tp=1: transformers' model on meta (no distribution), filled from a directory, then from a rank file."""
    full = transformers.AutoModelForCausalLM.from_pretrained(fill_root / "llama").eval()
    ids = ids_for(256)
    for source in (llama_shards["tp1"], llama_shards["tp1"] / "rank-00000-of-00001.safetensors"):
        model = reshard.empty_tp_model(source)
        report = reshard.fill_model(model, source)
        assert report.tensors == len(full.state_dict()) and report.bytes == (
            llama_shards["tp1"] / "rank-00000-of-00001.safetensors").stat().st_size
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, full(input_ids=ids).logits)


@pytest.mark.pure
def test_expert_views_follow_transformers_conversion_mapping(fill_root: Path) -> None:
    """Each per-expert tensor's view is the block transformers' own loading puts it in."""
    model = transformers.AutoModelForCausalLM.from_pretrained(fill_root / "moe", dtype=torch.float32)
    with safe_open(str(fill_root / "moe" / "model.safetensors"), "pt") as f:
        ckpt = {k: f.get_tensor(k).float() for k in f.keys()}
    state = model.state_dict()
    views = expert_views(state, shard_layout(model, list(ckpt)).pieces, {k: v.shape for k, v in ckpt.items()})
    assert len(views) == 2 * 4 * 3
    for name, v in views.items():
        assert torch.equal(v.view, ckpt[name]), name
        assert v.view.data_ptr() != ckpt[name].data_ptr()
        assert v.view.untyped_storage().data_ptr() == state[v.param].untyped_storage().data_ptr()


@pytest.mark.pure
def test_renamed_and_fused_mixtral_experts(save_hf_ckpt: Any, tmp_path: Path) -> None:
    """Mixtral's checkpoint says `block_sparse_moe.experts.E.w1/w3/w2`; transformers renames and fuses
    them into `mlp.experts.gate_up_proj`/`down_proj`; fill_model follows the same mapping."""
    from reshard.cli import main

    config = {"model_type": "mixtral", "intermediate_size": 96, "num_local_experts": 3, "num_experts_per_tok": 2,
              "dtype": "float32", **SMALL}
    src = save_hf_ckpt(tmp_path / "mixtral", config, 7)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in f.keys()
    (src / "reshard-rules.yaml").write_text("rules: []\n")  # tp=1: every tensor whole
    assert main(["write", str(src), "--tp", "1", "-o", str(tmp_path / "s")]) == 0
    model = reshard.empty_tp_model(tmp_path / "s")
    report = reshard.fill_model(model, tmp_path / "s")
    assert report.fused == 2 * 3 * 3
    full = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ids = ids_for(SMALL["vocab_size"])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, full(input_ids=ids).logits)


@pytest.mark.pure
def test_a_shard_missing_an_expert_is_refused(fill_root: Path, tmp_path: Path) -> None:
    """A model with 5 experts per layer, a shard of a 4-expert checkpoint: the fused parameters are
    only partly covered, which is said, and nothing is filled."""
    from reshard.cli import main

    assert main(["write", str(fill_root / "moe"), "--tp", "1", "-o", str(tmp_path / "s")]) == 0
    config = json.loads((fill_root / "moe" / "config.json").read_text())
    config.update(num_experts=5, num_local_experts=5)
    bigger = reshard.empty_tp_model(config)
    with pytest.raises(PlanError, match=r"experts.gate_up_proj \(the shard has 8 of its 2 x 5 per-expert tensors\)"):
        reshard.fill_model(bigger, tmp_path / "s")

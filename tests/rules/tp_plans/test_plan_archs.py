"""Every architecture of `tests/support/plan_archs.py`, planned from config.json alone, holds on each rank what transformers' own TP holds.

The reference is transformers itself: the checkpoint loaded with `tp_plan="auto"` on 2 gloo ranks, each
rank's `DTensor.to_local()`. Disk tensors that transformers fuses on load (per-expert MoE weights) are
stacked and concatenated with transformers' own conversion mapping before comparing. Where reshard
splits a fused tensor per block on purpose (`colwise_gather_output` on Phi-3-style `qkv_proj` /
`gate_up_proj`), the rank tensor equals the per-block split of the full tensor computed with torch, and
transformers' is checked to be the plain contiguous chunk.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.format.rank_file import rank_file_name
from reshard.rules.tp_plans import live_entry
from tests.support.plan_archs import (
    ARCHS,
    DENSE,
    MOES,
    Built,
    HFNames,
    full_checkpoint,
    fuse_experts,
    same_tensor,
)


def _per_block(t: torch.Tensor, blocks: list[int], rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    return torch.cat([torch.chunk(b, tp, dim=dim)[rank] for b in torch.split(t, blocks, dim=dim)], dim=dim)


def per_block_split(model_type: str, name: str, t: torch.Tensor, config: dict[str, Any]) -> tuple[int, list[int]] | None:
    """(dim, block sizes) where reshard splits a fused tensor per block and transformers does not."""
    if model_type in {"phi3", "glm", "glm4"}:
        blocks = _blocks(name, config)
        return (0, blocks) if blocks else None
    if model_type == "inkling_text" and name.endswith(".experts.gate_up_proj"):  # [E, 2*inter, hidden]
        return 1, [t.shape[1] // 2] * 2
    return None


def _blocks(name: str, config: dict[str, Any]) -> list[int] | None:
    """Block sizes of a Phi-3-style fused tensor, from config.json (independent of reshard)."""
    if ".qkv_proj." in name:
        h, kv = config["num_attention_heads"], config["num_key_value_heads"]
        hd = config.get("head_dim") or config["hidden_size"] // h
        return [h * hd, kv * hd, kv * hd]
    if ".gate_up_proj." in name:
        return [config["intermediate_size"]] * 2
    return None


def compare_with_transformers(built: Built, tp: int = 2) -> dict[str, Any]:
    """Compare every tensor of every rank; return what was found (for the coverage table)."""
    config = json.loads((built.ckpt / "config.json").read_text())
    full = full_checkpoint(built.ckpt)
    names = HFNames(built.arch.model_type)
    per_block, fused, sharded = set(), set(), set()
    for rank in range(tp):
        ours = load_file(str(built.out[tp] / rank_file_name(rank, tp)))
        theirs = load_file(str(built.hf_rank_file(rank)))
        assert sorted(ours) == sorted(full), "rank file names differ from the checkpoint's"
        groups: dict[str, tuple[Any, dict[int, dict[int, torch.Tensor]]]] = {}
        seen = set()
        for name, got in ours.items():
            mem, conv, src = names(name)
            if got.shape != full[name].shape:
                sharded.add(name)
            if conv is not None:
                expert = int(re.search(r"experts\.(\d+)\.", name).group(1))
                groups.setdefault(mem, (conv, {}))[1].setdefault(src, {})[expert] = got
                continue
            assert mem in theirs, f"{name} -> {mem}: not in transformers' state dict"
            seen.add(mem)
            split = per_block_split(built.arch.model_type, name, full[name], config)
            if split is not None and theirs[mem].shape != full[name].shape:
                dim, blocks = split
                per_block.add(name)
                same_tensor(got, _per_block(full[name], blocks, rank, tp, dim), f"{name} rank {rank} (per-block split)")
                same_tensor(theirs[mem], torch.chunk(full[name], tp, dim=dim)[rank], f"transformers' {mem} rank {rank}")
            else:
                same_tensor(got, theirs[mem], f"{name} rank {rank}")
        for mem, (conv, pieces) in groups.items():
            fused.add(mem)
            seen.add(mem)
            same_tensor(fuse_experts(conv, pieces), theirs[mem], f"{mem} rank {rank} (rebuilt from per-expert shards)")
        rest = set(theirs) - seen
        for mem in rest:  # tied heads: transformers lists lm_head, the checkpoint holds the embedding only
            assert mem.endswith("lm_head.weight") and config.get("tie_word_embeddings", True), mem
    return {"sharded": len(sharded), "per_block": sorted(per_block), "fused_experts": sorted(fused)}


@pytest.mark.pure
def test_enough_architectures() -> None:
    assert len(DENSE) >= 20 and len(MOES) >= 6 and len(ARCHS) >= 30
    traits = {t for a in ARCHS for t in a.traits}
    assert {"tied", "bias", "qk_norm", "mla"} <= traits
    assert {"mixtral", "deepseek_v3"} <= {a.model_type for a in MOES}


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", [a.model_type for a in ARCHS])
def test_tp2_equals_transformers_tp(zoo: dict[str, Built], coverage: dict[str, dict[str, Any]], model_type: str) -> None:
    built = zoo[model_type]
    built.require("build", "reshard write --tp 2")
    record = coverage.setdefault(model_type, {"moe": built.arch.moe})
    record["planned_from"] = built.source
    built.require("transformers TP load")
    found = compare_with_transformers(built)
    assert found["sharded"] > 0, "nothing was sharded"
    if built.arch.moe and "fused_experts" not in built.arch.traits:
        assert found["fused_experts"], "no per-expert tensor was compared with transformers' fused experts"
    record.update(equal_tp2=True, fused_on_disk="fused_experts" in built.arch.traits and not found["fused_experts"]
                  and model_type != "gpt_oss", **found)


GPT_OSS_RULES = """\
# gpt-oss experts are fused on disk with gate and up interleaved on the last dim ([E, hidden, 2*inter]):
# a contiguous split of that dim keeps every (gate, up) pair on one rank.
rules:
  - {regex: 'model\\.layers\\.\\d+\\.mlp\\.experts\\.gate_up_proj(_bias)?', kind: expert_row}
  - {regex: 'model\\.layers\\.\\d+\\.mlp\\.experts\\.down_proj', kind: expert_column}
"""


@pytest.mark.multiproc
def test_gpt_oss_fused_experts_by_rules_file(zoo: dict[str, Built], tmp_path: Path) -> None:
    """transformers' gpt_oss plan shards only the embedding (its experts go to expert parallelism): a rules
    file splits the fused on-disk experts, every rank holding whole (gate, up) pairs of its inter slice."""
    import shutil

    from reshard import cli

    built = zoo["gpt_oss"]
    built.require("build")
    ckpt = Path(shutil.copytree(built.ckpt, tmp_path / "ckpt"))
    (ckpt / "reshard-rules.yaml").write_text(GPT_OSS_RULES)
    assert cli.main(["write", str(ckpt), "--tp", "2", "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    full = full_checkpoint(ckpt)
    for rank in range(2):
        got = load_file(str(tmp_path / "out" / rank_file_name(rank, 2)))
        for layer in range(2):
            pre = f"model.layers.{layer}.mlp.experts."
            gate_up, bias, down = full[pre + "gate_up_proj"], full[pre + "gate_up_proj_bias"], full[pre + "down_proj"]
            for view in (slice(0, None, 2), slice(1, None, 2)):  # gate, then up: this rank's inter slice of each
                same_tensor(got[pre + "gate_up_proj"][..., view], torch.chunk(gate_up[..., view], 2, dim=-1)[rank], pre)
                same_tensor(got[pre + "gate_up_proj_bias"][..., view], torch.chunk(bias[..., view], 2, dim=-1)[rank], pre)
            same_tensor(got[pre + "down_proj"], torch.chunk(down, 2, dim=1)[rank], pre + "down_proj")
            same_tensor(got[pre + "down_proj_bias"], full[pre + "down_proj_bias"], pre + "down_proj_bias")


@pytest.mark.multiproc
def test_inkling_fused_gate_up_keeps_gate_and_up_paired(zoo: dict[str, Built]) -> None:
    """transformers' inkling_text plan says `colwise` for the fused experts' `gate_up_proj` `[E, 2*inter, hidden]`,
    whose forward is `gate, up = linear(x, W).chunk(2, -1)`: its Shard(1) gives rank 0 only gate rows, so the
    ranks' partial expert outputs no longer sum to the full one. reshard's per-block split does."""
    built = zoo["inkling_text"]
    built.require("build", "reshard write --tp 2", "transformers TP load")
    full = full_checkpoint(built.ckpt)
    pre = "model.layers.1.mlp.experts."
    torch.manual_seed(0)
    x = torch.randn(3, full[pre + "gate_up_proj"].shape[-1])

    def expert(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)

    want = expert(full[pre + "gate_up_proj"][0], full[pre + "down_proj"][0])
    ours = [load_file(str(built.out[2] / rank_file_name(r, 2))) for r in range(2)]
    theirs = [load_file(str(built.hf_rank_file(r))) for r in range(2)]
    if "layers.*.mlp.experts.gate_up_proj" not in live_entry("inkling_text").base_plan:
        # transformers 5.25 no longer splits experts by TP (the newest-versions lane): every rank holds them whole
        for held in ours + theirs:
            for n in (pre + "gate_up_proj", pre + "down_proj"):
                assert torch.equal(held[n], full[n]), n
        return
    ours_sum = sum(expert(o[pre + "gate_up_proj"][0], o[pre + "down_proj"][0]) for o in ours)
    theirs_sum = sum(expert(t[pre + "gate_up_proj"][0], t[pre + "down_proj"][0]) for t in theirs)
    torch.testing.assert_close(ours_sum, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(theirs_sum, want, rtol=1e-3, atol=1e-4)

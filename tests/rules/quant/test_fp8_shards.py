"""FP8 rank shards against the full checkpoint: each rank's weight, scale and dequantized weight."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main
from reshard.errors import ManifestError, PlanError
from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.rules.kinds import tensor_selection
from reshard.testing.synth import llama_config
from tests.support.fp8_ckpt import (
    BLOCK_QC,
    CASES,
    TPS,
    block_of,
    dequant_ref,
    dequantized_state,
    fp8_checkpoint,
    write,
)
from tests.support.rank_files import differing_ranks, rank_file, same_bytes, written_ranks
from tests.support.tp_math import linear_index, llama_rules

pytestmark = pytest.mark.pure


def take(t: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None) -> torch.Tensor:
    if rows is not None:
        t = t.index_select(0, rows)
    return t.index_select(1, cols) if cols is not None else t


def blocks(index: torch.Tensor | None, block: int | None) -> torch.Tensor | None:
    """The scale entries along one dim that cover `index` (a single scale when block is None)."""
    if index is None:
        return None
    return torch.zeros(1, dtype=torch.long) if block is None else torch.unique_consecutive(index // block)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_its_blocks(ckpts: Path, shards: Any, case: str) -> None:
    cfg, qc = CASES[case]
    block = block_of(qc)
    full = load_file(ckpts / case / "model.safetensors")
    deq = dequantized_state(ckpts / case, qc)
    weights = [n for n in full if n.endswith(".weight") and full[n].dtype == torch.float8_e4m3fn]
    assert len(weights) == (4 if "phi3" in case else 7)
    for tp in TPS:
        for rank in range(tp):
            local, desc = rank_file(shards(case, tp) / rank_file_name(rank, tp))
            for name in weights:
                stem = name[: -len(".weight")]
                scale_name = next(stem + s for s in (".weight_scale_inv", ".weight_scale") if stem + s in full)
                rows, cols = linear_index(name.split(".")[-2], cfg, tp, rank)
                assert same_bytes(local[name], take(full[name], rows, cols)), (case, tp, rank, name)
                per_tensor = full[scale_name].numel() == 1  # every rank: the one scale
                want_scale = full[scale_name] if per_tensor else take(
                    full[scale_name], blocks(rows, block[0]), blocks(cols, block[1]))
                assert same_bytes(local[scale_name], want_scale), (case, tp, rank, scale_name)
                got = dequant_ref(local[name], local[scale_name], block)
                assert torch.equal(got, take(deq[name], rows, cols)), (case, tp, rank, name)
                assert desc[scale_name]["kind"] == desc[name]["kind"] and desc[name]["kind"].endswith("_fp8")
                if stem + ".input_scale" in full:  # a static activation scale: every rank, all of it
                    assert same_bytes(local[stem + ".input_scale"], full[stem + ".input_scale"])
            assert desc["model.embed_tokens.weight"]["kind"] == "vocab_embed"  # not quantized: plain kinds
            assert set(local) == set(full)


# works: the tp values that cut this down_proj on block edges; plans: those that also split the model's 2
# attention heads (the error names the tp values that plan the whole checkpoint)
@pytest.mark.parametrize(("intermediate", "tp", "works", "plans"), [(1536, 8, "{1,2,3,4,6,12}", "1, 2"),
                                                                   (320, 2, "{1}", "1")])
def test_boundary_inside_a_block_is_an_error_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], intermediate: int, tp: int, works: str, plans: str
) -> None:
    cfg = llama_config(hidden_size=256, num_attention_heads=2, head_dim=128, num_key_value_heads=2,
                       intermediate_size=intermediate, num_hidden_layers=1)
    src = fp8_checkpoint(tmp_path / "ckpt", cfg, BLOCK_QC)
    out = tmp_path / "out"
    assert main(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("reshard: error: model.layers.0.mlp.down_proj.weight: ")
    for part in (f"dim 1 has size {intermediate}", f"tp={tp}", "scale block of 128",
                 f"pick a tp that plans this checkpoint: {plans} (rule"):
        assert part in err, (part, err)
    assert not out.exists()
    # exactly the tps it lists split this row weight (dim 1 cut every size/tp) on block edges
    ckpt, manifest = open_source(src)
    name = "model.layers.0.mlp.down_proj.weight"
    shape, rule = ckpt.tensors[name].shape, manifest.match(name)
    listed = set(map(int, works.strip("{}").split(",")))
    for t in range(1, 17):
        if intermediate % t:
            continue
        assert (t in listed) == (t == 1 or intermediate // t % 128 == 0), t
        if t in listed:
            assert [tensor_selection(name, shape, rule, r, t)[1] for r in range(t)] == [
                ((r * intermediate // t, (r + 1) * intermediate // t),) for r in range(t)]
        else:
            with pytest.raises(PlanError, match="inside a scale block of 128"):
                [tensor_selection(name, shape, rule, r, t) for r in range(t)]


def test_merge_returns_the_original_bytes(ckpts: Path, shards: Any, tmp_path: Path) -> None:
    for case, tp in (("block", 8), ("block_phi3", 4), ("channel", 8), ("tensor", 2)):
        summary = merge(shards(case, tp), tmp_path / case, progress=False)
        assert summary["files"] == ["model.safetensors"]
        for fname in ("model.safetensors", "config.json"):
            assert (tmp_path / case / fname).read_bytes() == (ckpts / case / fname).read_bytes(), (case, fname)
        assert "quantization_config" in json.loads((tmp_path / case / "config.json").read_text())


def test_fp8_shards_reshard_to_another_tp(shards: Any, tmp_path: Path) -> None:
    for case in ("block", "block_phi3", "channel"):
        assert differing_ranks(write(shards(case, 4), 2, tmp_path / case), shards(case, 2), 2) == [], case


RULES = llama_rules("_fp8", heads=8, kv_heads=2, options="block: [128, 128]")


def test_a_rules_file_says_the_same_explicitly(ckpts: Path, shards: Any, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    for tp in (2, 8):
        assert differing_ranks(write(ckpts / "block", tp, tmp_path / f"tp{tp}", "--rules", str(rules)),
                               shards("block", tp), tp) == [], tp


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
      "strategy": "group", "group_size": 128}}}}, "group 'g' has 4-bit int weights; only 8-bit float"),
])
def test_packed_formats_are_refused_not_missplit(tmp_path: Path, qc: dict[str, Any], message: str) -> None:
    src = fp8_checkpoint(tmp_path / "ckpt", llama_config(num_hidden_layers=1), BLOCK_QC)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ManifestError, match=re.escape(message)):
        open_source(src)


def test_unquantized_checkpoint_with_a_quantization_config_plans_as_before(tmp_path: Path) -> None:
    """A dequantized checkpoint (no scale tensors) that kept its quantization_config gets plain kinds."""
    src = fp8_checkpoint(tmp_path / "ckpt", llama_config(num_hidden_layers=1), BLOCK_QC)
    state = dequantized_state(src, BLOCK_QC)
    from safetensors.torch import save_file

    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    plan = make_plan(*open_source(src), 2)
    assert {t.kind for t in plan.ranks[0].tensors} == {"column", "row", "vocab_embed", "replicate"}


def test_unquantized_modules_and_biases_keep_their_plain_rule(tmp_path: Path) -> None:
    """qwen2 (q/k/v biases) with layer 1's down_proj left in bf16: that weight and every bias keep the
    plain kind, the quantized weights of the same rules get the `_fp8` twin."""
    cfg = llama_config(model_type="qwen2", hidden_size=256, num_attention_heads=2, head_dim=128,
                       num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2)
    kept = "model.layers.1.mlp.down_proj.weight"
    src = fp8_checkpoint(tmp_path / "ckpt", cfg, BLOCK_QC, keep=(kept,))
    full = load_file(src / "model.safetensors")
    for rank, (local, desc) in enumerate(written_ranks(src, 2, tmp_path / "tp2")):
        assert desc[kept]["kind"] == "row" and local[kept].dtype == torch.bfloat16
        assert torch.equal(local[kept], full[kept].chunk(2, dim=1)[rank])
        assert desc["model.layers.0.mlp.down_proj.weight"]["kind"] == "row_fp8"
        for layer in (0, 1):
            bias = f"model.layers.{layer}.self_attn.q_proj.bias"
            assert desc[bias]["kind"] == "column"
            assert torch.equal(local[bias], full[bias].chunk(2)[rank])
            assert desc[f"model.layers.{layer}.self_attn.q_proj.weight_scale_inv"]["kind"] == "column_fp8"


def test_a_replicated_quantized_weight_keeps_its_full_scale(tmp_path: Path) -> None:
    """A tp_plan without o_proj: o_proj's FP8 weight and its scale go whole to every rank (replicate_fp8)."""
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    cfg = llama_config(hidden_size=256, num_attention_heads=2, head_dim=128, num_key_value_heads=2,
                       intermediate_size=256, num_hidden_layers=1, base_model_tp_plan=plan)
    src = fp8_checkpoint(tmp_path / "ckpt", cfg, BLOCK_QC)
    full = load_file(src / "model.safetensors")
    out = write(src, 2, tmp_path / "tp2")
    for rank in range(2):
        local, desc = rank_file(out / rank_file_name(rank, 2))
        for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale_inv"):
            assert desc[name]["kind"] == "replicate_fp8" and same_bytes(local[name], full[name]), name
        assert same_bytes(local["model.layers.0.mlp.down_proj.weight_scale_inv"],
                          full["model.layers.0.mlp.down_proj.weight_scale_inv"][:, rank : rank + 1])


def test_misaligned_scale_rules_name_the_rule(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "ckpt", llama_config(num_hidden_layers=1), BLOCK_QC)
    rules = tmp_path / "r.yaml"
    rules.write_text('rules:\n  - pattern: "*.q_proj.*"\n    kind: column_fp8\n    block: 128\n')
    with pytest.raises(PlanError, match=r"q_proj.weight: rule '\*.q_proj.\*' \(column_fp8\): `block` must be a list"):
        make_plan(*open_source(src, rules=rules), 2)

"""Int4 MoE checkpoints: per-expert quantized modules (Qwen3-MoE, GPTQ and AWQ as their tools write them)
under tensor and expert parallelism, and fused n-D experts (`[E, N, K/8]`, compressed-tensors) by a rules
file; every rank's tensors checked from what it records (tests/support/int4_checks.py), the experts each
rank holds against expert parallelism's math, and merges byte for byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.cli import main
from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.hf_checkpoint import merge
from reshard.layout import Layout
from tests.support.int4_checks import check_rank_file
from tests.support.int4_ckpt import awq_qc, ct_qc, dequantized_weights, gptq_qc, quantize, quantize_checkpoint

pytestmark = pytest.mark.pure

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "num_experts": 4, "num_experts_per_tok": 2}
QCS = {"gptq": gptq_qc(8), "awq": awq_qc(8)}
LAYOUTS = [Layout(tp=2), Layout(tp=4), Layout(fsdp=2, ep=2), Layout(fsdp=2, tp=2, ep=4)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3-MoE (transformers' from_config + save_pretrained: per-expert tensors on disk), quantized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("int4-moe")
    out = {}
    for name, qc in QCS.items():
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **SIZES)).save_pretrained(root / name)
        out[name] = quantize_checkpoint(root / name, qc)
    return out


def layout_args(layout: Layout) -> list[str]:
    return [a for d in ("tp", "fsdp", "ep") if getattr(layout, d) > 1 for a in (f"--{d}", str(getattr(layout, d)))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.dir_name())
@pytest.mark.parametrize("case", list(QCS))
def test_experts_under_tp_and_ep(moe: dict[str, Path], case: str, layout: Layout, tmp_path: Path) -> None:
    src, qc = moe[case], QCS[case]
    out = tmp_path / "out"
    assert main(["write", str(src), *layout_args(layout), "-o", str(out), "--no-progress"]) == 0
    full = load_file(src / "model.safetensors")
    deq = dequantized_weights(src, qc)
    held: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    files = sorted(out.glob("rank-*.safetensors"))
    assert len(files) == layout.world
    for path in files:
        rank = int(path.name.split("-")[1])
        c = layout.coords(rank)
        for stem, idx in check_rank_file(path, full, deq, qc).items():
            held.setdefault(stem, []).append(idx)
            if ".experts." in stem:  # experts e of ep rank r: [r * E/ep, (r + 1) * E/ep), cut by tp within
                expert = int(stem.split(".experts.")[1].split(".")[0])
                assert expert // (SIZES["num_experts"] // layout.ep) == c.ep, (path.name, stem)
                n, k = idx
                rows, cols = deq[stem + ".weight"].shape
                tp_split = layout.tp if layout.ep == 1 else 1  # (transformers' plans: EP experts whole)
                if stem.endswith("down_proj"):
                    assert (len(n), len(k)) == (rows, cols // tp_split), (path.name, stem)
                else:
                    assert (len(n), len(k)) == (rows // tp_split, cols), (path.name, stem)
    experts = [s for s in held if ".experts." in s]
    assert len(experts) == 2 * 4 * 3  # every expert module of both layers is on some rank
    merged = merge(out, tmp_path / "merged", progress=False)
    assert merged["files"] == ["model.safetensors"]
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


# fused experts on disk ([E, N, K/8] per tensor), as compressed-tensors packs 3-D MoE weights
E, H, INTER = 4, 32, 32
FUSED_RULES = """\
rules:
  - pattern: "model.layers.*.mlp.experts.gate_up_proj.*"
    kind: expert_column_ct_int4
    parts: 2
    group_size: 8
    zero_points: 8
  - pattern: "model.layers.*.mlp.experts.down_proj.*"
    kind: expert_row_ct_int4
    group_size: 8
    zero_points: 8
"""


def fused_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    qc = ct_qc(8, sym=False)
    gen = torch.Generator().manual_seed(5)
    state: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(H)}
    for name, (n, k) in (("gate_up_proj", (2 * INTER, H)), ("down_proj", (H, INTER))):
        per = [quantize("ct", torch.randn(n, k, generator=gen) * 0.05, group=8, sym=False) for _ in range(E)]
        for suffix in per[0]:
            stacked = torch.stack([p[suffix] for p in per])
            state[f"model.layers.0.mlp.experts.{name}.{suffix}"] = (
                torch.tensor([E, n, k]) if suffix == "weight_shape" else stacked)
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "custom", "quantization_config": qc}))
    (path / "rules.yaml").write_text(FUSED_RULES)
    return state, qc


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_nd_experts_split_by_a_rules_file(tmp_path: Path, tp: int) -> None:
    state, qc = fused_checkpoint(tmp_path / "ckpt")
    deq = {f"model.layers.0.mlp.experts.{m}.weight": torch.stack([
        _dequant_expert(state, m, e) for e in range(E)]) for m in ("gate_up_proj", "down_proj")}
    out = tmp_path / "out"
    assert main(["write", str(tmp_path / "ckpt"), "--tp", str(tp), "--rules", str(tmp_path / "ckpt" / "rules.yaml"),
                 "-o", str(out), "--no-progress"]) == 0
    for rank in range(tp):
        held = check_rank_file(out / rank_file_name(rank, tp), state, deq, qc)
        experts, n, k = held["model.layers.0.mlp.experts.gate_up_proj"]
        half = torch.arange(INTER).chunk(tp)[rank]
        assert torch.equal(experts, torch.arange(E)) and torch.equal(n, torch.cat([half, INTER + half]))
        assert torch.equal(k, torch.arange(H))
        experts, n, k = held["model.layers.0.mlp.experts.down_proj"]
        assert torch.equal(n, torch.arange(H)) and torch.equal(k, half)
    merge(out, tmp_path / "merged", progress=False)
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (tmp_path / "ckpt" / "model.safetensors").read_bytes()


def _dequant_expert(state: dict[str, torch.Tensor], module: str, e: int) -> torch.Tensor:
    from tests.support.int4_ckpt import dequantize

    t = {s.rsplit(".", 1)[1]: v[e] for s, v in state.items() if f".{module}." in s and not s.endswith("weight_shape")}
    k = t["weight_packed"].shape[1] * 8
    return dequantize("ct", t, groups=torch.arange(k) // 8)

"""tp=4 with 2 kv heads (fewer than tp, where transformers' own TP stops): kv heads replicated, checked with torch."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.format.rank_file import rank_file_name
from tests.support.plan_archs import ARCHS, Built, full_checkpoint

pytestmark = pytest.mark.multiproc

TP = 4


def _head_slice(t: torch.Tensor, heads: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's heads along dim 0; with fewer heads than ranks, head rank // (tp // heads) (torch slicing)."""
    hd = t.shape[0] // heads
    if heads >= tp:
        return torch.chunk(t, tp, dim=0)[rank]
    h = rank // (tp // heads)
    return t[h * hd:(h + 1) * hd]


@pytest.mark.parametrize("model_type", [a.model_type for a in ARCHS])
def test_tp4_kv_heads_replicated(zoo: dict[str, Built], coverage: dict[str, dict[str, Any]], model_type: str) -> None:
    built = zoo[model_type]
    built.require("build", f"reshard write --tp {TP}")
    config = json.loads((built.ckpt / "config.json").read_text())
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv = config.get("num_key_value_heads") or heads
    full = full_checkpoint(built.ckpt)
    kv_names = [n for n in full if n.endswith((".k_proj.weight", ".v_proj.weight", ".k_proj.bias", ".v_proj.bias"))]
    fused = [n for n in full if n.endswith(".qkv_proj.weight")] if model_type == "phi3" else []
    if kv_names and "reshard write --tp 2" not in built.errors:  # the plan leaves attention whole (embedding only)
        tp2 = load_file(str(built.out[2] / rank_file_name(0, 2)))
        kv_names = [n for n in kv_names if tp2[n].shape != full[n].shape]
    record = coverage.setdefault(model_type, {"moe": built.arch.moe})
    if kv >= TP or not (kv_names or fused):
        record["kv_replicated_tp4"] = None  # not applicable: no separate GQA kv heads below tp
        why = f"{kv} kv heads, not fewer than tp={TP}" if kv >= TP else "its plan leaves attention whole"
        pytest.skip(f"{model_type}: {why}")
    checked = 0
    for rank in range(TP):
        got = load_file(str(built.out[TP] / rank_file_name(rank, TP)))
        for name in kv_names:
            want = _head_slice(full[name], kv, rank, TP)
            assert torch.equal(got[name], want), f"{name} rank {rank}/{TP}"
            checked += 1
        for name in (n.replace("k_proj", "q_proj") for n in kv_names if ".k_proj." in n):
            if name in full and full[name].shape[0] % heads == 0:
                assert torch.equal(got[name], torch.chunk(full[name], TP, dim=0)[rank]), f"{name} rank {rank}"
        for name in fused:
            hd = full[name].shape[0] // (heads + 2 * kv)
            q, k, v = torch.split(full[name], [heads * hd, kv * hd, kv * hd])
            want = torch.cat([_head_slice(q, heads, rank, TP), _head_slice(k, kv, rank, TP), _head_slice(v, kv, rank, TP)])
            assert torch.equal(got[name], want), f"{name} rank {rank}/{TP}"
            checked += 1
    assert checked
    record["kv_replicated_tp4"] = True

"""`fill_model(model, source, follow="model")`: the model says what each rank holds (its DTensor placements,
from whatever TP plan the installed transformers applied), reshard reads those blocks as boxes of the
checkpoint. Against transformers' own `from_pretrained(tp_plan="auto")` at tp=2: every local tensor equal
bit for bit, for a dense llama and a qwen3_moe whose experts transformers fuses and packs (gate|up as a
strided shard) - with no rules file consulted (the moe checkpoint's is there and ignored)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import reshard
from reshard.errors import PlanError
from tests.support.fill_checks import run_distributed, same_bits
from tests.support.follow_checks import follow_model_job

transformers = pytest.importorskip("transformers")

TP = 2


@pytest.mark.servers
def test_follow_model_equals_transformers_own_tp_load(fill_root: Path, fill_server: Any) -> None:
    cases = {name: {"path": str(fill_root / name), "url": fill_server.ckpt_url(name),
                    "vocab": json.loads((fill_root / name / "config.json").read_text())["vocab_size"]}
             for name in ("llama", "moe")}
    found = run_distributed(follow_model_job, TP, cases, fill_server.url, timeout=300.0)
    for name in cases:
        for rank, per in enumerate(found):
            r = per[name]
            assert r["differ"] == [], (name, rank, r["differ"])
            assert r["max_diff"] <= 1e-6, (name, rank, r["max_diff"])
            assert r["served"] == r["bytes"] and r["verified"] == "sha256"
            itemsize = 4 if name == "llama" else 2  # bfloat16 on disk, float32 parameters
            assert r["held"] * itemsize < r["bytes"] <= r["held"] * itemsize + (64 << 10), (name, rank, r)
        assert (found[0][name]["fused"] > 0) == (name == "moe")


@pytest.mark.pure
def test_a_model_the_checkpoint_does_not_fit_is_refused_before_a_byte(fill_root: Path) -> None:
    config = json.loads((fill_root / "moe" / "config.json").read_text())
    bigger = reshard.empty_tp_model({**config, "num_experts": 5, "num_local_experts": 5})
    before = {n: t.clone() for n, t in bigger.state_dict().items()}
    with pytest.raises(PlanError, match=r"experts.(gate_up|down)_proj: the model's tensor has shape \[5, .* make \[4, "):
        reshard.fill_model(bigger, fill_root / "moe", follow="model")
    wider = reshard.empty_tp_model({**json.loads((fill_root / "llama" / "config.json").read_text()), "vocab_size": 300})
    with pytest.raises(PlanError, match=r"model and checkpoint disagree, nothing was filled: .*embed_tokens.weight: "
                                        r"the model's global shape \[300, 64\], the checkpoint's \[256, 64\]"):
        reshard.fill_model(wider, fill_root / "llama", follow="model")
    assert all(same_bits(t, before[n]) for n, t in bigger.state_dict().items())  # nothing was written

"""`fill_model(model, source)` follows the model: it says what each rank holds (its DTensor placements, from
whatever TP plan the installed transformers applied). `follow="model"` reads those blocks as boxes of the
checkpoint; the default ("auto") takes the rank's shard where it holds exactly those blocks, else the boxes.
Against transformers' own `from_pretrained(tp_plan="auto")` at tp=2, under whichever transformers is
installed (the pinned 5.24 and the newest lane's 5.25, `./run test-newest`): every local tensor equal bit
for bit and the logits, for a dense llama and a qwen3_moe whose experts transformers fuses and packs
(gate|up as a strided shard; 5.25 no longer splits them, the checkpoint's rules file does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import reshard
from reshard.errors import PlanError
from reshard.rules.tp_plans.entry import table_version
from tests.support.fill_checks import run_distributed, same_bits
from tests.support.follow_checks import follow_model_job

transformers = pytest.importorskip("transformers")

TP = 2


@pytest.mark.servers
def test_fill_model_equals_transformers_own_tp_load(fill_root: Path, fill_server: Any) -> None:
    """`follow="model"` and the default, each into its own `empty_tp_model`, against transformers' TP load."""
    cases = {name: {"path": str(fill_root / name), "url": fill_server.ckpt_url(name),
                    "vocab": json.loads((fill_root / name / "config.json").read_text())["vocab_size"]}
             for name in ("llama", "moe")}
    found = run_distributed(follow_model_job, TP, cases, fill_server.url, ("model", "auto"), timeout=300.0)
    table_release = transformers.__version__ == table_version()
    for name in cases:
        for rank, per in enumerate(found):
            for follow, r in per[name].items():
                assert r["differ"] == [], (name, follow, rank, r["differ"])
                assert r["max_diff"] <= 1e-6, (name, follow, rank, r["max_diff"])
                assert r["verified"] == "sha256"
                # what the service sent: the rank's shard or the boxes' answer; where the default found the shard
                # disagreeing and followed the model, also the start of the shard it dropped after its header
                dropped = follow == "auto" and r["followed"] == "model"
                assert r["served"] >= r["bytes"] if dropped else r["served"] == r["bytes"], (name, follow, rank, r)
                itemsize = 4 if name == "llama" else 2  # bfloat16 on disk, float32 parameters
                assert r["held"] * itemsize < r["bytes"] <= r["held"] * itemsize + (64 << 10), (name, rank, r)
            assert per[name]["model"]["followed"] == "model"
            # the rank files are cut by the shipped table (the llama) and a rules file (the moe), both as 5.24 plans
            # them: under that release the shard holds what the model holds; under another, where it does not
            # (5.25's unsplit experts), the default reads the model's blocks
            assert per[name]["auto"]["followed"] == "shard" if table_release else per[name]["auto"]["followed"] in (
                "shard", "model"), (name, rank, per[name]["auto"])
        assert (found[0][name]["model"]["fused"] > 0) == (name == "moe")


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

"""Training checkpoints of an MoE model (qwen3_moe: fused expert parameters, whose moments are saved and
filled through views): save at step 3 of 6 at tp=2 and resume at tp=2 (bit for bit), at tp=1 and at tp=4
(within float32 noise); the tp=2 checkpoint's merged moments equal the tp=1 run's.

The references: the uninterrupted tp=2 run, and the tp=1 run of the same model and data (in process).
One 2-rank group runs both tp=2 runs, one 4-rank group the tp=4 resume.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.format.rank_file import OPTIMIZER_DIR
from reshard.io.sinks.hf_checkpoint import merge
from tests.support.dist import run_distributed
from tests.support.trainer_archs import make_checkpoint, write_shards
from tests.support.trainer_checks import RESUME_ARGS, RESUME_STEPS, checkpoint_tensors, read_metrics

LOSS_ATOL = 1e-5  # float32 reduction-order noise over 3 steps (measured: about 1e-6)


def _train(*args: str) -> dict[str, Any]:
    from reshard.cli.train import parse_args, train

    with contextlib.redirect_stdout(io.StringIO()):
        return train(parse_args([*args, *RESUME_ARGS]))


def _tp2_job(rank: int, world: int, shards: str, root: str) -> None:
    """The uninterrupted 6-step tp=2 run checkpointing at step 3, then the resume from step-3 at tp=2."""
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    _train("--shards", shards, "--steps", str(RESUME_STEPS), "--save", f"{root}/a", "--save-every", "3",
           "--metrics", f"{root}/a.json")
    _train("--resume", f"{root}/a/step-3", "--steps", str(RESUME_STEPS), "--save", f"{root}/b", "--metrics", f"{root}/b.json")


def _tp4_job(rank: int, world: int, root: str) -> None:
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    _train("--resume", f"{root}/a/step-3", "--steps", str(RESUME_STEPS), "--metrics", f"{root}/tp4.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tp=1 in process (6 steps, checkpoint at 3; and the tp=2 checkpoint resumed at tp=1), tp=2 in 2 gloo
    ranks, the tp=4 resume in 4."""
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("resume_moe")
    full = make_checkpoint("qwen3_moe", root / "full")
    for tp in (1, 2):
        write_shards(full, tp, root / f"tp{tp}")
    _train("--shards", str(root / "tp1"), "--steps", str(RESUME_STEPS), "--save", str(root / "r1"), "--save-every", "3",
           "--metrics", str(root / "r1.json"))
    run_distributed(_tp2_job, 2, str(root / "tp2"), str(root), timeout=180)
    _train("--resume", str(root / "a" / "step-3"), "--steps", str(RESUME_STEPS), "--metrics", str(root / "tp1.json"))
    run_distributed(_tp4_job, 4, str(root), timeout=180)
    return root


@pytest.mark.multiproc
def test_moe_resume_at_tp2_is_exact(runs: Path) -> None:
    a, b = read_metrics(runs / "a.json"), read_metrics(runs / "b.json")
    assert (a["tp"], b["tp"], b["first_step"], len(b["losses"])) == (2, 2, 4, 3)
    assert b["losses"] == a["losses"][3:]  # bit for bit
    ta, tb = checkpoint_tensors(runs / "a", 2), checkpoint_tensors(runs / "b", 2)
    assert sorted(ta) == sorted(tb)
    assert any(".experts." in k and k.endswith(".exp_avg_sq") for k in ta), sorted(ta)[:5]  # the fused experts' moments
    unequal = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert unequal == [], unequal[:5]


@pytest.mark.multiproc
def test_moe_resume_at_tp1_and_tp4_agrees(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = read_metrics(runs / "a.json")["losses"][3:]
    tp1 = read_metrics(runs / "r1.json")["losses"]
    diffs = {"uninterrupted tp=1": max(abs(x - y) for x, y in zip(read_metrics(runs / "a.json")["losses"], tp1, strict=True))}
    for name, layout in (("tp1", {"dp": 1, "tp": 1}), ("tp4", {"dp": 1, "tp": 4})):
        m = read_metrics(runs / f"{name}.json")
        assert (m["layout"], m["first_step"], m["samples"]) == (layout, 4, RESUME_STEPS * 2)
        diffs[f"resumed at tp={layout['tp']}"] = max(abs(x - y) for x, y in zip(m["losses"], ref, strict=True))
    with capsys.disabled():
        print("\nqwen3_moe vs the tp=2 run, max |loss diff|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert all(d < LOSS_ATOL for d in diffs.values()), diffs


@pytest.mark.multiproc
def test_moe_merged_moments_equal_tp1(runs: Path) -> None:
    """The tp=2 checkpoint's moments, merged (experts fused back), are the tp=1 run's, within fp32 noise."""
    merge(runs / "a" / "step-3" / OPTIMIZER_DIR, runs / "m2", progress=False)
    merge(runs / "r1" / "step-3" / OPTIMIZER_DIR, runs / "m1", progress=False)
    m2, m1 = load_file(runs / "m2" / "model.safetensors"), load_file(runs / "m1" / "model.safetensors")
    assert sorted(m2) == sorted(m1)
    assert any(".experts." in k for k in m1)
    worst = 0.0
    for k in m1:
        torch.testing.assert_close(m2[k], m1[k], atol=1e-6, rtol=1e-3, msg=k)
        worst = max(worst, (m2[k] - m1[k]).abs().max().item())
    print(f"merged moments tp=2 vs tp=1: max |diff| {worst:.2e}")

"""The TP trainer end to end: `python -m reshard.cli.train` at tp=2 against tp=1 (losses and merged weights)
for a dense and a MoE architecture, the merged result in transformers' `from_pretrained`, resharding of
shards, and the peak memory of the meta-device build.
"""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.hf_checkpoint import merge
from reshard.testing.synth import llama_config, make_checkpoint
from reshard.trainer import build_model
from tests.support.trainer_archs import ARCHS, IDS, reference_model, write_shards
from tests.support.trainer_checks import PYTHON, REPO, build_memory_job, run_distributed, run_train

TPS = (1, 2, 4)
LOSS_ATOL = 1e-5
WEIGHT_ATOL = 1e-5
LR = 1e-4
# Adam divides by sqrt(v) + 1e-8: for an element whose gradient is within ~1e-8 of zero at some step,
# fp32 rounding noise (different summation order per tp) moves its update by up to ~lr. Such elements
# are rare (~1 in 1e5 per step); they may exceed WEIGHT_ATOL, bounded by that update size. The
# gradients themselves are compared element by element in `test_architectures.py`.
MAX_NOISY_FRACTION = 1e-3


# --- resharding the shards --------------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2)])
def test_reshard_of_shards_equals_direct_write(arch_work: Path, tmp_path: Path, src_tp: int, dst_tp: int) -> None:
    for name in ("llama_tied", "mixtral"):
        out = write_shards(arch_work / name / f"tp{src_tp}", dst_tp, tmp_path / name)
        direct = arch_work / name / f"tp{dst_tp}"
        files = [rank_file_name(r, dst_tp) for r in range(dst_tp)]
        match, mismatch, errors = filecmp.cmpfiles(out, direct, files, shallow=False)
        assert (match, mismatch, errors) == (files, [], []), name


# --- training ----------------------------------------------------------------------------------------

TRAINED = ("llama", "qwen3_moe")  # a dense and a MoE architecture
STEPS = 3


@pytest.fixture(scope="module")
def trained(arch_work: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """`reshard.cli.train` for 3 steps at tp=1 (in process) and tp=2 (torchrun), saved and merged."""
    out = {}
    for name in TRAINED:
        for tp in (1, 2):
            run = arch_work / f"train_{name}_tp{tp}"
            proc = run_train(arch_work / name / f"tp{tp}", tp, steps=STEPS, save=run / "saved",
                             metrics=run / "metrics.json", lr=LR)
            merge(run / "saved", run / "merged", progress=False)
            out[name, tp] = {"proc": proc, "metrics": json.loads((run / "metrics.json").read_text()),
                             "saved": run / "saved", "merged": run / "merged",
                             "weights": load_file(run / "merged" / "model.safetensors")}
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("name", TRAINED)
def test_tp2_training_matches_tp1(trained: dict, arch_work: Path, name: str) -> None:
    run, ref = trained[name, 2], trained[name, 1]
    m, r = run["metrics"], ref["metrics"]
    assert (m["tp"], m["steps"], len(m["losses"])) == (2, STEPS, STEPS)
    assert (r["tp"], r["steps"], len(r["losses"])) == (1, STEPS, STEPS)
    for step, (a, b) in enumerate(zip(m["losses"], r["losses"], strict=True)):
        assert abs(a - b) < LOSS_ATOL, f"step {step + 1}: tp=2 loss {a} vs tp=1 loss {b}"
    original = load_file(arch_work / name / "full" / "model.safetensors")
    weights, expected = run["weights"], ref["weights"]
    assert sorted(weights) == sorted(expected) == sorted(original)  # names on disk (per-expert for MoE)
    noisy = 0
    for key in expected:
        diff = (weights[key] - expected[key]).abs()
        noisy += int((diff > WEIGHT_ATOL).sum())
        assert diff.max() <= LR * STEPS, (key, diff.max().item())  # see MAX_NOISY_FRACTION
    moved = [k for k in expected if (expected[k] - original[k]).abs().max() > 10 * WEIGHT_ATOL]
    assert len(moved) > 0.9 * len(expected), f"training moved only {len(moved)} of {len(expected)} tensors"
    total = sum(t.numel() for t in expected.values())
    assert noisy <= max(2, MAX_NOISY_FRACTION * total), f"{noisy} of {total} weights differ by > {WEIGHT_ATOL}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", TRAINED)
def test_merged_training_result_loads_with_from_pretrained(trained: dict, arch_work: Path, name: str) -> None:
    merged = trained[name, 2]["merged"]
    assert json.loads((merged / "config.json").read_text())["model_type"] == ARCHS[name][0]
    model, untrained = reference_model(merged), reference_model(arch_work / name / "full")
    with torch.no_grad():
        after, before = model(input_ids=IDS).logits, untrained(input_ids=IDS).logits
    assert (after - before).abs().max() > 1e-3  # trained: the logits moved
    built = build_model(trained[name, 1]["saved"]).eval()  # the tp=1 save builds again, same logits
    with torch.no_grad():
        torch.testing.assert_close(built(input_ids=IDS).logits, reference_model(trained[name, 1]["merged"])(
            input_ids=IDS).logits, atol=1e-5, rtol=0)


@pytest.mark.multiproc
def test_training_under_reshard_launch_equals_torchrun(trained: dict, arch_work: Path, tmp_path: Path) -> None:
    """The same run forked by `reshard launch` (reshard.cli.launch): the same losses and saved weights, bit for bit."""
    run_train(arch_work / "llama" / "tp2", 2, steps=STEPS, save=tmp_path / "saved", metrics=tmp_path / "metrics.json",
              lr=LR, launcher="reshard")
    metrics, ref = json.loads((tmp_path / "metrics.json").read_text()), trained["llama", 2]
    assert metrics["tp"] == 2 and metrics["losses"] == ref["metrics"]["losses"]
    files = [rank_file_name(r, 2) for r in range(2)]
    assert filecmp.cmpfiles(tmp_path / "saved", ref["saved"], files, shallow=False) == (files, [], [])


@pytest.mark.multiproc
def test_tp1_run_without_torchrun_prints_losses(trained: dict) -> None:
    stdout = trained["llama", 1]["proc"].stdout
    printed = [float(x) for x in re.findall(rf"^step +\d+/{STEPS} +loss (\S+)", stdout, flags=re.M)]
    losses = trained["llama", 1]["metrics"]["losses"]
    assert printed == [round(x, 4) for x in losses], stdout
    assert all(3.0 < x < 60.0 for x in losses), losses


@pytest.mark.multiproc
def test_train_help() -> None:
    proc = subprocess.run([PYTHON, "-m", "reshard.cli.train", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--shards", "--steps", "--save", "--metrics", "--seq-len", "--dtype", "--warmup", "--min-lr",
                   "--max-norm", "--dp"):
        assert option in proc.stdout


# --- memory of the meta-device build ---------------------------------------------------------------

BIG = llama_config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)
MB = 1 << 20


@pytest.mark.multiproc
def test_build_peak_memory_shrinks_with_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = make_checkpoint(tmp_path / "full", BIG)
    state = load_file(full / "model.safetensors")
    model_bytes = sum(t.nbytes for t in state.values())
    replicated = sum(t.nbytes for k, t in state.items() if k.endswith("norm.weight"))
    del state
    assert 60 * MB < model_bytes < 90 * MB
    peaks: dict[int, list[dict[str, int]]] = {}
    for tp in TPS:
        shards = write_shards(full, tp, tmp_path / f"tp{tp}")
        peaks[tp] = run_distributed(build_memory_job, tp, str(shards), timeout=180.0)
        for rank, res in enumerate(peaks[tp]):
            file_bytes = (shards / rank_file_name(rank, tp)).stat().st_size
            assert res["param_bytes"] <= file_bytes <= res["param_bytes"] + MB
            assert res["peak_increase"] >= res["param_bytes"] * 0.9, (tp, rank, res)
            assert res["peak_increase"] < model_bytes / tp + replicated + 30 * MB, (tp, rank, res)
            assert res["peak_increase"] < file_bytes + 30 * MB, (tp, rank, res)
    worst = {tp: max(r["peak_increase"] for r in peaks[tp]) for tp in TPS}
    with capsys.disabled():
        print(f"\nbuild_model peak RSS increase per rank (model {model_bytes / MB:.1f} MiB): " + ", ".join(
            f"tp={tp}: " + "/".join(f"{r['peak_increase'] / MB:.1f}" for r in peaks[tp]) + " MiB" for tp in TPS))
    assert worst[2] < 0.7 * worst[1], worst
    assert worst[4] < worst[2] * 0.9, worst

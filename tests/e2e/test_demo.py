"""`reshard demo` end to end (tiny preset): serve, 2-rank torchrun pulling over HTTP, merge, verify."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.format.checkpoint import Checkpoint

pytestmark = pytest.mark.e2e

RESHARD = [sys.executable, "-m", "reshard.cli"]


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(RESHARD + args, capture_output=True, text=True, timeout=420, env=env, **kw)


def test_demo_end_to_end(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    r = _run(["demo", "--workdir", str(work), "--preset", "tiny", "--steps", "4", "--seq-len", "16", "--batch-size", "2"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for n in range(1, 7):
        assert f"==> {n}/6" in out
    assert "merged checkpoint verified" in out
    metrics = json.loads((work / "metrics.json").read_text())
    assert len(metrics["losses"]) == 4 and all(x == x for x in metrics["losses"])
    full = Checkpoint.open(work / "checkpoints" / "demo-llama")
    # each rank pulled about half the sharded bytes plus the replicated ones: never the whole checkpoint
    per_rank = metrics["shard_bytes_per_rank"]
    assert len(per_rank) == 2 and all(0.4 * full.total_bytes() < n < 0.75 * full.total_bytes() for n in per_rank)
    assert len(re.findall(r"rank \d pulled .* of the .* checkpoint", out)) == 2
    # the merged checkpoint has the original names and shapes; trained weights moved away from the source
    merged = Checkpoint.open(work / "merged")
    assert {k: t.shape for k, t in merged.tensors.items()} == {k: t.shape for k, t in full.tensors.items()}
    src = {}
    for f in full.files:
        src.update(load_file(f.path))
    got = load_file(work / "merged" / "model.safetensors")
    moved = [k for k in src if not torch.allclose(got[k].float(), src[k].float())]
    assert moved, "training changed no weight"
    assert (work / "loss.png").stat().st_size > 1000


def test_demo_failure_stops_everything(tmp_path: Path) -> None:
    # tp=3 cannot split 4 attention heads: the workers fail, the demo says so and stops the service
    work = tmp_path / "demo"
    r = _run(["demo", "--workdir", str(work), "--preset", "tiny", "--steps", "2", "--tp", "3"])
    assert r.returncode != 0
    assert "torchrun job failed" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("reshard: error:")
    leftover = subprocess.run(["pgrep", "-f", f"--root {work}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "the demo left its service running"


def test_demo_json_is_the_summary_alone_on_stdout(tmp_path: Path) -> None:
    """`reshard demo --json`: stdout is one JSON document (the summary: losses, bytes per rank, the merge
    verified), the account of each step on stderr."""
    work = tmp_path / "demo"
    r = _run(["demo", "--workdir", str(work), "--preset", "tiny", "--steps", "2", "--seq-len", "16", "--batch-size", "2",
              "--json"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert len(summary["losses"]) == 2 and summary["verified_tensors"] > 0 and len(summary["shard_bytes_per_rank"]) == 2
    assert summary["merged"] == str(work / "merged") and "==> 6/6" in r.stderr and "==>" not in r.stdout

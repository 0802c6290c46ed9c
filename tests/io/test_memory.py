"""Bounded memory: writing tensors many times the chunk size raises peak RSS by a few chunks, not a tensor.

Measured in a fresh process (reshard and torch imported first), with the kernel's peak-RSS mark reset
just before the write, so the figure is the write's own peak.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard.io.rank_stream import CHUNK
from tests.support.peak_rss import PRELUDE

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
LIMIT = 40 * MiB

SCRIPT = PRELUDE + r"""
import json, sys
import torch  # noqa: F401  (its import is part of the baseline, not of the write)
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.io.sinks.writer import write_to_dir  # the stream's own memory: no mapped source pages

ckpt, manifest = open_source(sys.argv[1], rules=sys.argv[2])
plan = make_plan(ckpt, manifest, 2)
before = reset_peak()
write_to_dir(ckpt, plan, sys.argv[3], progress=False)
print(json.dumps({"before": before, "after": status("VmHWM"), "bytes": sum(r.size for r in plan.ranks)}))
"""


def test_peak_memory_of_a_write_is_bounded(tmp_path: Path) -> None:
    rows = 96 * MiB // 4 // 8192
    big = torch.arange(rows * 8192, dtype=torch.float32).reshape(rows, 8192)  # 96 MiB
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"big_row.weight": big, "big_col.weight": big.T.contiguous(), "norm.weight": torch.ones(8192)},
              str(ckpt / "model.safetensors"))
    del big
    assert 96 * MiB >= 8 * CHUNK
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {pattern: big_row.weight, kind: row}\n  - {pattern: big_col.weight, kind: column}\n")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt), str(rules), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    assert m["bytes"] > 192 * MiB
    increase = m["after"] - m["before"]
    assert increase < LIMIT, f"peak RSS rose by {increase / MiB:.1f} MiB writing {m['bytes'] / MiB:.0f} MiB"
    assert (tmp_path / "out" / "rank-00001-of-00002.safetensors").stat().st_size > 96 * MiB

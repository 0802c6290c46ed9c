"""`reshard serve --workers N` keeps prometheus_client's per-worker files in a directory named for its
supervisor; one whose supervisor is gone (SIGKILLed: its `finally` never ran) is removed by the next start,
and nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from reshard.io.owners import owner_tag
from reshard.service.process import workers

pytestmark = pytest.mark.pure


def test_a_gone_supervisors_metrics_dir_is_removed_and_no_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; from reshard.io.owners import owner_tag; print(owner_tag())"],
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.strip()
    gone = tmp_path / f"reshard-metrics-{dead}-abc"
    live = tmp_path / f"reshard-metrics-{owner_tag()}-def"  # a supervisor still running (this process)
    untagged = tmp_path / "reshard-metrics-xyz"  # an older version's: no owner to ask
    other = tmp_path / f"other-{dead}-x"
    for d in (gone, live, untagged, other):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    made = Path(workers._metrics_dir())
    assert not gone.exists()
    assert live.is_dir() and untagged.is_dir() and other.is_dir()
    assert made.parent == tmp_path and made.name.startswith(f"reshard-metrics-{owner_tag()}-") and made.is_dir()

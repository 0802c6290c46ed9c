"""Row-split gathers from leased mappings (`reshard.io.source.mapped_files`): the same bytes as pread, and a
file truncated under them gives back its lease at once, fails the stream and never faults the process.

Each case runs in a fresh interpreter (the SIGIO handler is process-wide, and a fault would kill the
whole test run): the child prints what it saw as JSON and the test asserts on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.io.rank_stream import RankStream
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from tests.support.live import make_ckpt

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]
ROW = {"rules": [{"pattern": "*_proj.weight", "kind": "row"}]}


@pytest.fixture(scope="module")
def row_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_ckpt(tmp_path_factory.mktemp("mapped") / "ckpt", hidden_size=512, intermediate_size=1536,
                  num_hidden_layers=2, vocab_size=1024, num_attention_heads=8, num_key_value_heads=8)
    (d / "reshard-rules.json").write_text(json.dumps(ROW))
    return d


def _child(script: str, *args: str, timeout: float = 120) -> dict:
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child exited {r.returncode} (a negative code is a signal: -7 SIGBUS)\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


SAME_BYTES = """
import hashlib, json, sys
from reshard.plan.planner import make_plan
from reshard.io.source.opener import open_source
from reshard.io.source.mapped_files import MAPS
from reshard.io.rank_stream import RankStream
ckpt, manifest = open_source(sys.argv[1])
tp = int(sys.argv[2])
plan = make_plan(ckpt, manifest, tp)
out = {"enabled": MAPS.enable(), "sha": []}
for rank in range(tp):
    with RankStream(plan.ranks[rank], chunk_size=1 << 20) as stream:
        out["sha"].append(hashlib.sha256(b"".join(bytes(c) for c in stream.chunks())).hexdigest())
out["mapped"] = MAPS.mapped_bytes
print(json.dumps(out))
"""


@pytest.mark.parametrize("tp", [2, 4])
def test_gathers_from_mappings_equal_pread(row_ckpt: Path, tp: int) -> None:
    import hashlib

    ckpt, manifest = open_source(row_ckpt)
    plan = make_plan(ckpt, manifest, tp)
    want = []
    for rank in range(tp):  # this process never enabled mappings: pread and gather, as before
        with RankStream(plan.ranks[rank], chunk_size=1 << 20) as stream:
            want.append(hashlib.sha256(b"".join(bytes(c) for c in stream.chunks())).hexdigest())
    got = _child(SAME_BYTES, str(row_ckpt), str(tp))
    assert got["enabled"] and got["mapped"] == sum(f.stat().st_size for f in row_ckpt.glob("*.safetensors"))
    assert got["sha"] == want


TRUNCATE = """
import json, subprocess, sys, threading, time
from reshard.errors import SourceChangedError
from reshard.plan.planner import make_plan
from reshard.io.source.opener import open_source
from reshard.io.source.mapped_files import MAPS
from reshard.io.rank_stream import RankStream
ckpt, manifest = open_source(sys.argv[1])
plan = make_plan(ckpt, manifest, 2)
assert MAPS.enable()
weights = sys.argv[1] + "/model.safetensors"
state = {"passes": 0, "error": None}
stop = threading.Event()

def read():  # gathers without pause, so the truncation comes while one is inside the mapping
    try:
        while not stop.is_set():
            with RankStream(plan.ranks[0], chunk_size=256 << 10) as stream:
                for _ in stream.chunks(reuse=True):
                    pass
            state["passes"] += 1
    except SourceChangedError as e:
        state["error"] = str(e)

reader = threading.Thread(target=read)
reader.start()
while state["passes"] < 2:
    time.sleep(0.01)
mapped = MAPS.mapped_bytes
t0 = time.monotonic()
subprocess.run([sys.executable, "-c", f"open({weights!r}, 'wb').write(b'x' * 1000)"], check=True, timeout=60)
waited = time.monotonic() - t0
reader.join(30)
stop.set()
print(json.dumps({"mapped": mapped, "waited": waited, "error": state["error"], "alive": reader.is_alive(),
                  "after": MAPS.mapped_bytes}))
"""


def test_truncated_under_a_mapping_gives_the_lease_back_and_fails_the_stream(row_ckpt: Path, tmp_path: Path) -> None:
    import shutil

    victim = shutil.copytree(row_ckpt, tmp_path / "victim")
    got = _child(TRUNCATE, str(victim))
    assert got["mapped"] > 0, "the reader never mapped the file"
    assert got["waited"] < 10, "the truncating writer waited for the lease-break timeout (45 s)"
    assert got["error"] and "model.safetensors" in got["error"], got
    assert not got["alive"] and got["after"] == 0
    assert (victim / "model.safetensors").stat().st_size == 1000

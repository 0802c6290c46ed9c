"""Killed writers: `reshard write` SIGKILLed at random points, and a server stopped (SIGKILL, SIGTERM)
while its write jobs run. Never a final-named partial file, never a `reshard.json` that vouches for
bytes that are not there; a rerun completes; interrupted jobs are reported failed after a restart."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.format.rank_file import rank_file_name
from reshard.io.outfs import TMP_PREFIX
from reshard.io.sinks.writer import MANIFEST_NAME
from tests.support.hard import live_server, metric, wait_for
from tests.support.live import REPO, LiveServer, make_ckpt

pytestmark = pytest.mark.timeout(240)

SIZES = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 1, "vocab_size": 2048,
         "num_attention_heads": 8, "num_key_value_heads": 8}  # ~68 MB float32
TP = 4


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two versions of one checkpoint (same shapes, other weights) and their tp=4 rank files."""
    from reshard.cli import main

    base = tmp_path_factory.mktemp("kill")
    out: dict[str, Any] = {"base": base}
    for seed, label in ((0, "a"), (1, "b")):
        src = make_ckpt(base / label, seed=seed, **SIZES)
        ref = base / f"{label}-ref"
        assert main(["write", str(src), "--tp", str(TP), "-o", str(ref), "--no-progress"]) == 0
        out[label] = {"src": src, "ref": ref,
                      "files": {rank_file_name(r, TP): (ref / rank_file_name(r, TP)).read_bytes() for r in range(TP)}}
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _progress(out: Path, pid: int, before: dict[str, int]) -> int:
    """Bytes a writer with `pid` has stored in `out`: blocks of its temp files (rank files are sparse
    until written) plus the rank files it has published (a new inode under a final name)."""
    total = 0
    for p in list(out.iterdir()):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.name.startswith(f"{TMP_PREFIX}{pid}-"):
            total += st.st_blocks * 512
        elif p.name.startswith("rank-") and before.get(p.name) != st.st_ino:
            total += st.st_size
    return total


def _kill_at(argv: list[str], out: Path, fraction: float, total: int) -> int | None:
    """Run `reshard write` and SIGKILL it once it has stored `fraction` of `total` bytes."""
    before = {p.name: p.stat().st_ino for p in out.iterdir() if p.name.startswith("rank-")}
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: proc.poll() is not None or _progress(out, proc.pid, before) >= fraction * total,
                 timeout=60, step=0.001)
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        proc.kill()
        proc.communicate()
    return proc.returncode


def check_consistent(out: Path, allowed: dict[str, set[bytes]]) -> dict[str, bytes]:
    """Every final-named rank file is one complete allowed version; reshard.json, when present, lists
    only files that are there with the size and sha256 it says. Returns the final-named files."""
    finals = {p.name: p.read_bytes() for p in out.iterdir() if p.name.startswith("rank-")}
    for name, data in finals.items():
        assert data in allowed[name], f"{name}: a final-named file that is no complete version ({len(data)} bytes)"
    record_path = out / MANIFEST_NAME
    if record_path.exists():
        record = json.loads(record_path.read_text())
        for name, entry in record["files"].items():
            assert name in finals, f"reshard.json lists {name}, which is missing"
            assert (len(finals[name]), _sha(finals[name])) == (entry["size"], entry["sha256"]), \
                f"reshard.json vouches for other bytes than {name} holds"
    return finals


@pytest.mark.multiproc
def test_write_killed_at_random_points(versions: dict[str, Any]) -> None:
    """An older version sits in the output directory; writing the new one is SIGKILLed five times at
    random points of its progress; each time the directory is consistent; a last run completes."""
    from reshard.cli import main

    a, b = versions["a"], versions["b"]
    out = versions["base"] / "out"
    assert main(["write", str(a["src"]), "--tp", str(TP), "-o", str(out), "--no-progress"]) == 0
    allowed = {name: {a["files"][name], b["files"][name]} for name in a["files"]}
    total = sum(len(d) for d in b["files"].values())
    rng = random.Random(8)
    argv = [sys.executable, "-m", "reshard.cli", "write", str(b["src"]), "--tp", str(TP), "-o", str(out),
            "--no-progress"]
    killed_at = []
    for _ in range(5):
        fraction = rng.uniform(0.05, 0.95)
        rc = _kill_at(argv, out, fraction, total)
        killed_at.append(f"{fraction:.2f}:{'killed' if rc == -signal.SIGKILL else rc}")
        check_consistent(out, allowed)
    print(f"\nwrite kills (target fraction: outcome): {killed_at}")
    assert sum("killed" in k for k in killed_at) >= 3, killed_at

    rerun = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    finals = check_consistent(out, {name: {data} for name, data in b["files"].items()})
    assert finals == b["files"]
    record = json.loads((out / MANIFEST_NAME).read_text())
    assert record["plan"] == json.loads((b["ref"] / MANIFEST_NAME).read_text())["plan"]
    assert sorted(record["files"]) == sorted(b["files"])
    assert sorted(p.name for p in out.iterdir()) == sorted([*b["files"], MANIFEST_NAME, "config.json"])


# --- write jobs in a server that is stopped ------------------------------------------------------------

def _submit(srv: LiveServer, tp: int) -> dict[str, Any]:
    r = httpx.post(srv.ckpt_url("ck") + "/jobs", json={"tp": tp}, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()


def _temps(out: Path) -> list[Path]:
    return [p for p in out.rglob(f"{TMP_PREFIX}*")] if out.exists() else []


def _jobs_after_restart(root: Path, out: Path, ids: list[str]) -> list[dict[str, Any]]:
    with live_server(root, out=out) as srv:
        jobs = [httpx.get(f"{srv.url}/v1/jobs/{i}", timeout=10) for i in ids]
        assert all(r.status_code == 200 for r in jobs), [r.text for r in jobs]
        listed = {j["id"] for j in httpx.get(srv.url + "/v1/jobs").json()}
        assert set(ids) <= listed
        found = [r.json() for r in jobs]
        assert metric(srv, 'reshard_jobs{state="failed"}') == sum(j["state"] == "failed" for j in found)
        again = _submit(srv, found[0]["tp"])  # and jobs run again after the restart
        assert wait_for(lambda: httpx.get(f"{srv.url}/v1/jobs/{again['id']}").json()["state"] == "done", timeout=60)
        assert "Traceback" not in srv.log(), srv.log()
    return found


def _check_outputs(job: dict[str, Any], versions: dict[str, Any]) -> None:
    """Only complete files under final names; reshard.json only if it tells the truth."""
    out_dir = Path(job["output_dir"])
    tp = job["tp"]
    if not out_dir.exists():
        return
    ref = versions["base"] / f"job-ref-{tp}"
    if not ref.exists():
        from reshard.cli import main

        assert main(["write", str(versions["a"]["src"]), "--tp", str(tp), "-o", str(ref), "--no-progress"]) == 0
    allowed = {rank_file_name(r, tp): {(ref / rank_file_name(r, tp)).read_bytes()} for r in range(tp)}
    check_consistent(out_dir, allowed)
    if job["state"] == "done":
        assert (out_dir / MANIFEST_NAME).exists() and sorted(Path(p).name for p in job["outputs"]) == sorted(allowed)


@pytest.mark.servers
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_jobs_of_a_stopped_server_are_reported_failed(versions: dict[str, Any], tmp_path: Path,
                                                      sig: signal.Signals) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    (root / "ck").mkdir(parents=True)
    for f in versions["a"]["src"].iterdir():  # hard links: the checkpoint really lives under the root
        os.link(f, root / "ck" / f.name)
    with live_server(root, out=out, job_workers=1) as srv:
        jobs = [_submit(srv, tp) for tp in (1, 2, 4)]  # one runs, two wait in the queue
        assert wait_for(lambda: bool(_temps(out)), timeout=30, step=0.001), "no job started writing"
        t0 = time.monotonic()
        srv.proc.send_signal(sig)
        srv.proc.wait(timeout=30)
        stopped_in = time.monotonic() - t0
        log = srv.log()
    assert "Traceback" not in log, log
    assert stopped_in < 10, stopped_in  # a graceful stop does not wait for the jobs to finish
    found = _jobs_after_restart(root, out, [j["id"] for j in jobs])
    states = [j["state"] for j in found]
    assert set(states) <= {"done", "failed"} and "failed" in states, states
    for job in found:
        if job["state"] == "failed":
            assert job["error"]["error"] == "JobInterrupted" and "submit it again" in job["error"]["detail"], job
            assert job["outputs"] == []
        _check_outputs(job, versions)
    assert _temps(out) == [], _temps(out)  # the killed writer's temp files are gone after the restart

"""`reshard write` stopped mid-write by SIGTERM (or SIGINT): it cleans up as on any failure and says so in
one line, exit status 128 + the signal. To a local directory: no `.tmp-*` file left, and the output
directory it made for the run is gone again; to `s3://` (moto): no open multipart upload, no object.
The source is served slowly (a throttling proxy in front of a static Range server), so "mid-write" is
a state the test waits for, not a guess. And a write that fails for want of room leaves no directory.

`reshard pull` stopped mid-download the same way keeps what it has (`.NAME.part` and `.NAME.part.json`:
what it resumes from), says so in one line, exits 128 + the signal, and the same pull then resumes and
gives the shard `reshard write` gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from reshard.format.rank_file import rank_file_name
from reshard.io.outfs import TMP_PREFIX
from reshard.io.sinks.writer import PARTIAL_NAME
from reshard.testing.local_servers import StoreServer, http_server, s3_server
from tests.support.fs import Mount, assert_clean, reshard
from tests.support.hard import ThrottledProxy, wait_for
from tests.support.live import REPO, live_server, make_ckpt

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

BUCKET = "sigout"
SIZES = {"hidden_size": 512, "intermediate_size": 1024, "vocab_size": 2000, "num_attention_heads": 8,
         "num_key_value_heads": 8}  # ~28 MB: rank 0 of tp=2 is ~14 MB, two multipart parts
RANK0 = rank_file_name(0, 2)
RATE = 4e6  # bytes/s through the proxy, per connection: a rank takes seconds


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A slow HTTP source of the checkpoint and a moto S3 server with an empty bucket."""
    root = tmp_path_factory.mktemp("signals") / "root"
    make_ckpt(root / "mid", **SIZES)
    with http_server(root) as web, s3_server() as s3:
        host, port = web.url.removeprefix("http://").split(":")
        with ThrottledProxy((host, int(port)), rate=RATE, rcvbuf=64 << 10) as proxy:
            boto = _boto(s3)
            boto.create_bucket(Bucket=BUCKET)
            yield {"src": f"{proxy.url}/files/mid/", "s3": s3, "boto": boto}


def _boto(s3: StoreServer) -> Any:
    return boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"], region_name=s3.env["AWS_REGION"])


def _env(s3: StoreServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(s3.env, NO_PROXY="127.0.0.1,localhost", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


def _temps(top: Path) -> list[str]:
    return sorted(str(p) for p in top.rglob(f"{TMP_PREFIX}*")) if top.exists() else []


def _writing_locally(out: Path, pid: int) -> bool:
    """A temp rank file of `pid` holds data, and no rank file is published yet: mid-write of rank 0."""
    if not out.is_dir():
        return False
    names = [p for p in out.iterdir()]
    assert not any(p.name.startswith("rank-") for p in names), "a rank file was published before the signal"
    return any(p.name.startswith(f"{TMP_PREFIX}{pid}-") and p.stat().st_blocks > 0 for p in names)


def _stopped_midway(cmd: list[str], env: dict[str, str], midway: Callable[[int], bool], sig: signal.Signals) -> None:
    """Run `cmd`, send it `sig` once `midway(its pid)` holds; it must exit by itself with 128 + the
    signal (not die by it) and say so in one line, and nothing else."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = wait_for(lambda: proc.poll() is not None or midway(proc.pid), timeout=90, step=0.01)
        assert started and proc.poll() is None, ("the command ended before it could be stopped", proc.poll())
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, (proc.returncode, stderr)  # its own exit, not death by the signal
    assert stdout == "" and stderr.splitlines() == [f"reshard: interrupted by {sig.name}"], stderr


def _open_uploads(boto: Any) -> list[str]:
    return [u["Key"] for u in boto.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_write_stopped_mid_write_cleans_up(servers: dict[str, Any], tmp_path: Path, where: str,
                                           sig: signal.Signals) -> None:
    boto = servers["boto"]
    out_dir = tmp_path / "new" / "out"  # neither exists: the run makes both
    prefix = f"{where}-{sig.name.lower()}"
    out = str(out_dir) if where == "local" else f"s3://{BUCKET}/{prefix}"
    cmd = [sys.executable, "-m", "reshard.cli", "write", servers["src"], "--tp", "2", "-o", out, "--no-progress"]
    if where == "local":
        _stopped_midway(cmd, _env(servers["s3"]), lambda pid: _writing_locally(out_dir, pid), sig)
    else:
        _stopped_midway(cmd, _env(servers["s3"]), lambda pid: bool(_open_uploads(boto)), sig)
    assert _temps(tmp_path) == []
    if where == "local":
        left = sorted(os.listdir(out_dir)) if out_dir.exists() else []
        published = [n for n in left if n.startswith("rank-")]
        if not published:  # nothing published: the directories the run made are gone
            assert not (tmp_path / "new").exists(), left
        else:  # on a loaded machine the signal can land while rank 0 is being renamed: kept, recorded, resumable
            assert left == sorted([*published, PARTIAL_NAME]) and published == [RANK0], left
    else:
        assert _open_uploads(boto) == []  # aborted: nothing left for the store to bill
        assert boto.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []) == []


def test_write_without_room_leaves_no_directory(fs: Mount, ckpt: Path) -> None:
    fs.fill(leave=256 << 10)
    assert_clean(reshard("write", ckpt, "--tp", 2, "-o", fs.path / "new" / "out", "--no-progress"),
                 "MB free", "run the same command again")
    assert not (fs.path / "new").exists()
    (fs.path / "there").mkdir()  # a directory that was there before stays, empty as it was
    assert_clean(reshard("write", ckpt, "--tp", 2, "-o", fs.path / "there", "--no-progress"), "MB free")
    assert sorted(p.name for p in (fs.path / "there").iterdir()) == []


@pytest.fixture(scope="module")
def slow_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A `reshard serve` of the checkpoint behind the throttling proxy: (its checkpoint URL, the tp=2
    rank 0 `reshard write` gives)."""
    from reshard.cli import main

    root = tmp_path_factory.mktemp("pull-signals") / "root"
    make_ckpt(root / "mid", **SIZES)
    ref = root.parent / "ref"
    assert main(["write", str(root / "mid"), "--tp", "2", "-o", str(ref), "--no-progress"]) == 0
    with live_server(root, log_dir=root.parent) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with ThrottledProxy((host, int(port)), rate=RATE, rcvbuf=64 << 10) as proxy:
            yield f"{proxy.url}/v1/checkpoints/mid", ref / RANK0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_pull_stopped_mid_download_keeps_its_partial_file_and_resumes(slow_service: tuple[str, Path], tmp_path: Path,
                                                                      sig: signal.Signals) -> None:
    url, want = slow_service
    dest = tmp_path / "dl" / RANK0
    part, meta = dest.with_name(f".{RANK0}.part"), dest.with_name(f".{RANK0}.part.json")
    cmd = [sys.executable, "-m", "reshard.cli", "pull", url, "--rank", "0", "--tp", "2", "-o", str(dest), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    _stopped_midway(cmd, env, lambda pid: part.exists() and part.stat().st_size > 1 << 20, sig)
    kept = part.stat().st_size
    assert not dest.exists() and 1 << 20 <= kept < want.stat().st_size and meta.is_file()
    assert part.read_bytes() == want.read_bytes()[:kept]  # what it kept is the shard's beginning
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "resumed at" in again.stdout, again.stdout  # the result on stdout
    assert dest.read_bytes() == want.read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == [RANK0]  # no .part, no .part.json

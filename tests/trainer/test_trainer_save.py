"""The trainer's `--save` on full / read-only file systems and bad paths, and no hangs across ranks: when
one rank's save or build fails, every rank exits non-zero (not by a signal), with one line, within
LAG_S of the first rank to exit (a hang would wait for the process group's timeout, 30 minutes).

A model saved without training is byte-identical to the rank file it was built from (`reshard write`'s),
which is the reference for every save here."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from reshard.errors import NoSpaceError, OutputPathError, ReadOnlyError
from reshard.format.rank_file import rank_file_name
from tests.support.fs import KINDS, RANK1, TP, Mount, get_mount, leftovers, listing

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]
SOLO = rank_file_name(0, 1)
# the ranks of a run exit within LAG_S of each other (the failed rank's notice, a poll, a 5 s grace: a few
# seconds; generous for a loaded machine), and within LIMIT_S of the start (imports and building included,
# which a loaded machine stretches: at load average 14 a run took over 60 s); a rank still running after
# LIMIT_S is killed (a hang would wait for the process group's timeout, 30 minutes)
LAG_S = 30
LIMIT_S = 300


@pytest.fixture(scope="module")
def tp1(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reshard.io.sinks.write import write_shards
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    src, manifest = open_source(ckpt)
    out = tmp_path_factory.mktemp("tp1") / "shards"
    write_shards(src, make_plan(src, manifest, 1), out, progress=False)
    return out


@pytest.fixture(scope="module")
def model(tp1: Path) -> Any:
    from reshard.trainer.build import build_model

    return build_model(str(tp1))


def test_save_faults_then_identical(fs: Mount, model: Any, tp1: Path) -> None:
    from reshard.trainer.save import save_rank_shard

    save = fs.path / "save"
    size = (tp1 / SOLO).stat().st_size
    fs.fill(leave=1 << 20)
    with pytest.raises(NoSpaceError, match=f"needs {size / 1e6:.1f} MB in {save}, .* MB free; .*then train \\(or save\\) again"):
        save_rank_shard(model, save, config=model.hf_config)
    fs.unfill()
    save.mkdir(exist_ok=True)
    with fs.readonly(), pytest.raises(ReadOnlyError, match=f"{save}: read-only file system"):
        save_rank_shard(model, save, config=model.hf_config)
    afile = fs.path / "afile"
    afile.write_bytes(b"x")
    with pytest.raises(OutputPathError, match="exists and is not a directory"):
        save_rank_shard(model, afile)
    with pytest.raises(OutputPathError, match=f"{afile} is a file, not a directory"):
        save_rank_shard(model, afile / "sub")
    assert leftovers(fs.path) == [] and listing(save) == []
    path = save_rank_shard(model, save, config=model.hf_config)
    assert path.read_bytes() == (tp1 / SOLO).read_bytes()


# --- two real ranks (gloo), as torchrun would start them ----------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(shards: Path, saves: list[Path]) -> list[subprocess.Popen[str]]:
    port = _free_port()
    procs = []
    for rank, save in enumerate(saves):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(saves)),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "reshard.cli.train", "--shards", str(shards), "--steps", "0", "--dtype", "keep",
               "--threads", "1", "--save", str(save)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait(t0: float, *runs: list[subprocess.Popen[str]]) -> list[list[tuple[int, str, float]]]:
    """Per run, per rank: (exit status, stderr, seconds after the run's first rank exited), every rank of
    every run waited for at once (each one's time is its own); a rank still running LIMIT_S after t0 is
    killed."""

    def one(p: subprocess.Popen[str]) -> tuple[int, str, float]:
        try:
            _, err = p.communicate(timeout=max(1.0, t0 + LIMIT_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += f"\n(killed: still running {LIMIT_S} s after the start)"
        return p.returncode, err, time.monotonic()

    with ThreadPoolExecutor(sum(map(len, runs))) as pool:
        futures = [[pool.submit(one, p) for p in procs] for procs in runs]  # all submitted before any wait
        done = [[f.result() for f in run] for run in futures]
    return [[(rc, err, t - min(t for *_, t in ranks)) for rc, err, t in ranks] for ranks in done]


def _failed_cleanly(result: tuple[int, str, float], *needles: str) -> None:
    rc, err, lag = result
    assert rc == 1, (rc, err)
    assert lag < LAG_S, (lag, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("reshard.cli.train: error: "), err
    for needle in needles:
        assert needle in last, (needle, last)


@pytest.fixture(scope="module")
def tp2_shards(reference: dict[str, Path]) -> Path:
    """`reshard write --tp 2` of the checkpoint, with its reshard.json (the sha256 the trainer checks)."""
    return reference["write"]


def test_rank1_save_read_only_stops_both_ranks(mounts: dict[str, Any], tmp_path: Path, tp2_shards: Path) -> None:
    m = get_mount(mounts, next((k for k in KINDS if isinstance(mounts[k], Mount)), KINDS[0]))
    m.clean()
    saves = [tmp_path / "save0", m.path / "save1"]
    saves[1].mkdir()
    try:
        with m.readonly():
            t0 = time.monotonic()
            [res] = _wait(t0, _launch(tp2_shards, saves))
        _failed_cleanly(res[1], f"{saves[1]}", "read-only file system")
        _failed_cleanly(res[0], "PeerFailedError: rank 1 failed (ReadOnlyError", "rank 0 stops too")
        assert leftovers(saves[0]) == [] and listing(saves[1]) == []
        t0 = time.monotonic()
        [res] = _wait(t0, _launch(tp2_shards, saves))  # writable again: the same command succeeds
        assert [r[0] for r in res] == [0, 0], [r[1][-2000:] for r in res]
        for rank, save in enumerate(saves):
            name = rank_file_name(rank, TP)
            assert (save / name).read_bytes() == (tp2_shards / name).read_bytes()
    finally:
        m.clean()


def test_build_failure_on_one_rank_stops_both(tmp_path: Path, tp2_shards: Path) -> None:
    """Rank 1's shard missing (it fails before the collectives of building) and rank 1's shard corrupt
    (it fails in the sha256 check after them): two runs at once, each ends within the limit."""
    missing, corrupt = tmp_path / "missing", tmp_path / "corrupt"
    for d in (missing, corrupt):
        shutil.copytree(tp2_shards, d)
    (missing / RANK1).unlink()
    data = bytearray((corrupt / RANK1).read_bytes())
    data[-5] ^= 0x01
    (corrupt / RANK1).write_bytes(data)
    t0 = time.monotonic()
    runs = [_launch(d, [tmp_path / f"{d.name}-save{r}" for r in range(TP)]) for d in (missing, corrupt)]
    res_missing, res_corrupt = _wait(t0, *runs)
    _failed_cleanly(res_missing[1], f"no {RANK1} for tp={TP}")
    _failed_cleanly(res_missing[0], "PeerFailedError: rank 1 failed (CheckpointError")
    _failed_cleanly(res_corrupt[1], "sha256")
    _failed_cleanly(res_corrupt[0], "PeerFailedError: rank 1 failed")
    assert not (tmp_path / "missing-save1").exists() and not (tmp_path / "corrupt-save1").exists()
    assert not (tmp_path / "missing-save0").exists()  # rank 0 stopped while building: before --save

"""`reshard launch` (reshard.cli.launch) with real processes: torchrun's environment in every rank and
the modules imported before the fork, a failing rank stopping the others with one line, SIGINT and
SIGTERM forwarded, ranks that die with the launcher. The ranks run `tests/support/launch_rank.py`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
RANK = ["-m", "tests.support.launch_rank"]
ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}


def _launch(*args: str, console: bool = False) -> list[str]:
    if console:  # the `reshard` console script, which hands `launch` over before importing any other command
        return [str(Path(sys.executable).with_name("reshard")), "launch", *args]
    return [sys.executable, "-m", "reshard.cli.launch", *args]


def test_ranks_get_torchruns_environment_and_the_preloaded_modules(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                                  "intermediate_size": 128, "num_hidden_layers": 2,
                                                  "num_attention_heads": 4, "num_key_value_heads": 2}))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(_launch("--nproc-per-node", "2", "--preload", str(ckpt), *RANK, "env", str(out), "--x=1"),
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for r, rep in enumerate(reports):
        env = rep["env"]
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "ROLE_RANK")} == dict.fromkeys(("RANK", "LOCAL_RANK", "ROLE_RANK"), str(r))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("2", "2", "0", "1")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["OMP_NUM_THREADS"] == "1" and float(env["RESHARD_T0"]) > 0
        assert rep["elastic"] == [] and rep["name"] == "__main__" and rep["own_group"]
        assert rep["argv"][1:] == ["env", str(out), "--x=1"]
        assert all(rep["preloaded"].values()), rep["preloaded"]  # imported once, before the fork
        assert rep["sum"] == 3.0  # both ranks joined one gloo group through MASTER_ADDR:MASTER_PORT
    assert reports[0]["env"]["MASTER_PORT"] == reports[1]["env"]["MASTER_PORT"]
    assert reports[0]["ppid"] == reports[1]["ppid"]  # forked by one launcher
    assert reports[0]["rand"] != reports[1]["rand"]  # each rank seeded afresh, as a fresh process is


def test_a_failing_rank_stops_the_others_with_one_line(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(_launch("--nproc-per-node", "3", "--no-preload", "--grace", "2", *RANK, "fail", str(tmp_path),
                                  console=True), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - t0 < 60  # the sleeping ranks were stopped, not waited for
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("reshard launch")]
    assert len(lines) == 1 and "rank 1 " in lines[0] and "exited with status 3" in lines[0], proc.stderr
    assert "stopping the other 2 rank(s)" in lines[0]


def _up(out: Path, ranks: int, proc: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + 60
    while not all((out / f"up-{r}").is_file() and (out / f"up-{r}").read_text() for r in range(ranks)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return [int((out / f"up-{r}").read_text()) for r in range(ranks)]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_signals_reach_every_rank(tmp_path: Path, sig: int) -> None:
    """SIGINT and SIGTERM are forwarded (the launcher exits 128 + N); a SIGKILLed launcher takes its
    ranks with it (PR_SET_PDEATHSIG)."""
    proc = subprocess.Popen(_launch("--nproc-per-node", "2", "--no-preload", *RANK, "sleep", str(tmp_path)),
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = _up(tmp_path, 2, proc)
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    assert rc == (128 + sig if sig != signal.SIGKILL else -sig), proc.communicate()
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids)
    assert [(tmp_path / f"sigint-{r}").exists() for r in range(2)] == [sig == signal.SIGINT] * 2


def test_a_prefetch_fetcher_runs_at_the_lowest_cpu_priority() -> None:
    """`--prefetch`'s fetchers take only the CPU the launcher's imports leave: nice 19, the hash thread
    too. The fetcher here waits on a server that accepts and never answers; its niceness is read from
    /proc, then it is stopped."""
    import socket

    from reshard.io.client import shard_prefetch

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        url = f"http://127.0.0.1:{srv.getsockname()[1]}/v1/checkpoints/llama"
        got = shard_prefetch.start(url, 0, 2)
        try:
            conn, _ = srv.accept()  # the fetcher is asking: its priority is set by now
            with conn:
                fields = Path(f"/proc/{got['pid']}/stat").read_text().rsplit(")", 1)[1].split()
                assert int(fields[16]) == shard_prefetch.NICE == 19  # field 19 of stat: nice
        finally:
            os.kill(got["pid"], signal.SIGKILL)
            os.waitpid(got["pid"], 0)
            os.close(got["fd"])
            os.close(got["status"])

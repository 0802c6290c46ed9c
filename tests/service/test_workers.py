"""`reshard serve --workers 2`: any worker answers for any job, a job runs once, output directories are
written by one job at a time across workers, digests and metrics are shared, and the jobs of a worker
that is killed are reported failed by its replacement. One server for the module (spawning workers
costs seconds)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.format.rank_file import rank_file_name
from reshard.io.outfs import TMP_PREFIX
from tests.support.live import BIG, REPO, LiveServer, live_server, process_tree

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def srv2(ckpt_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(ckpt_root, out=tmp_path_factory.mktemp("out2"), log_dir=tmp_path_factory.mktemp("logs2"),
                     workers=2, chunk_size=256 << 10) as srv:
        yield srv
        assert srv.alive(), srv.log()


def _workers(srv: LiveServer) -> list[int]:
    """The worker processes (uvicorn's spawned children, not multiprocessing's resource tracker)."""
    out = []
    for pid in process_tree(srv.proc.pid)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmd and b"resource_tracker" not in cmd:
            out.append(pid)
    return out


def _metrics_dir(srv: LiveServer) -> Path:
    env = Path(f"/proc/{_workers(srv)[0]}/environ").read_bytes().split(b"\0")  # set by the supervisor
    return Path(next(e for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR=")).split(b"=", 1)[1].decode())


def _sample(srv: LiveServer, key: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(key))


def _fresh(url: str, **kw: Any) -> httpx.Response:
    """A request on its own connection, so the kernel may hand it to either worker."""
    with httpx.Client(timeout=60) as c:
        return c.get(url, headers={"Connection": "close"}, **kw)


@pytest.mark.servers
def test_two_workers_share_requests_metrics_and_digests(srv2: LiveServer, written: Any) -> None:
    assert len(_workers(srv2)) == 2
    target = f"{srv2.ckpt_url('llama')}/shards/1?tp=2"
    want = (written("llama", 2) / rank_file_name(1, 2)).read_bytes()
    def counting() -> set[int]:  # the workers that have counted something (one counter file each)
        return {int(m.group(1)) for f in _metrics_dir(srv2).iterdir() if (m := re.search(r"counter_(\d+)\.db$", f.name))}

    n = 0
    with ThreadPoolExecutor(16) as pool:
        # batches of 40 connections until both workers have served some (on a loaded machine the kernel
        # may hand one batch to one worker); at most 10 batches
        while n == 0 or (counting() != set(_workers(srv2)) and n < 400):
            bodies = list(pool.map(lambda _: _fresh(target).content, range(40)))
            assert all(b == want for b in bodies)
            n += 40
    assert counting() == set(_workers(srv2)), (counting(), n)
    # every worker's counts, whichever worker answers the scrape
    route = 'reshard_http_requests_total{method="GET",route="/v1/checkpoints/{name}/shards/{rank}",status="200"}'
    assert [_sample(srv2, route) for _ in range(4)] == [n] * 4
    assert _sample(srv2, "reshard_shard_bytes_served_total") == n * len(want)

    # a digest computed by one worker is known to all (and the first full download filled it already)
    digests = [_fresh(f"{srv2.ckpt_url('llama')}/shards/1/digest", params={"tp": 2}).json() for _ in range(10)]
    assert {d["sha256"] for d in digests} == {hashlib.sha256(want).hexdigest()}
    assert all(d["cached"] for d in digests)
    assert _sample(srv2, 'reshard_shard_digests_total{cache="hit"}') == 10


@pytest.mark.servers
def test_jobs_run_once_one_at_a_time_per_directory_across_workers(srv2: LiveServer, written: Any) -> None:
    with ThreadPoolExecutor(6) as pool:  # six jobs for one output directory, accepted by either worker
        subs = list(pool.map(lambda _: httpx.post(srv2.ckpt_url(BIG) + "/jobs", json={"tp": 2},
                                                  headers={"Connection": "close"}, timeout=60), range(6)))
    assert all(r.status_code == 202 for r in subs), [r.text for r in subs]
    ids = [r.json()["id"] for r in subs]

    def states() -> list[dict[str, Any]]:
        return [_fresh(f"{srv2.url}/v1/jobs/{i}").json() for i in ids]

    deadline = time.monotonic() + 240
    jobs = states()
    while not all(j["state"] in ("done", "failed") for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.2)
        jobs = states()
    assert [j["state"] for j in jobs] == ["done"] * 6, jobs
    assert all(j["bytes_done"] == j["bytes_total"] > 0 for j in jobs)
    spans = sorted((j["started_at"], j["finished_at"]) for j in jobs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # never two at once in one directory
    out = Path(jobs[0]["output_dir"])
    for r in range(2):
        assert (out / rank_file_name(r, 2)).read_bytes() == (written(BIG, 2) / rank_file_name(r, 2)).read_bytes()
    listed = {j["id"] for j in _fresh(srv2.url + "/v1/jobs").json()}
    assert set(ids) <= listed
    assert _sample(srv2, 'reshard_jobs{state="done"}') >= 6


@pytest.mark.servers
def test_jobs_of_killed_workers_are_failed_by_their_replacements(srv2: LiveServer) -> None:
    ids = []
    for tp in (1, 2, 4, 1, 2, 4):  # several directories: some run, some wait in a worker's queue
        r = httpx.post(srv2.ckpt_url(BIG) + "/jobs", json={"tp": tp}, timeout=60)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    old = _workers(srv2)
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the supervisor starts two new workers
        now = _workers(srv2)
        if len(now) == 2 and not set(now) & set(old):
            try:
                if httpx.get(srv2.url + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    jobs = [_fresh(f"{srv2.url}/v1/jobs/{i}").json() for i in ids]
    assert all(j["state"] in ("done", "failed") for j in jobs), [j["state"] for j in jobs]
    failed = [j for j in jobs if j["state"] == "failed"]
    assert failed, "every job had finished before the kill"
    assert all(j["error"]["error"] == "JobInterrupted" and j["outputs"] == [] for j in failed)
    out = Path(jobs[0]["output_dir"]).parent
    assert not [p for p in out.rglob(f"{TMP_PREFIX}*")], "a killed job's temp files were left"
    again = httpx.post(srv2.ckpt_url(BIG) + "/jobs", json={"tp": 2}, timeout=60).json()
    deadline = time.monotonic() + 120
    while _fresh(f"{srv2.url}/v1/jobs/{again['id']}").json()["state"] not in ("done", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert _fresh(f"{srv2.url}/v1/jobs/{again['id']}").json()["state"] == "done"


@pytest.mark.multiproc
def test_signal_storm_never_deadlocks_the_stop() -> None:
    """SIGTERM after SIGTERM (a supervisor forwarding, an operator's kill, a container runtime): the
    handler's `stop` runs once, so a signal that lands inside it cannot wait on a lock it holds (it did:
    a worker hung in `Event.set` nested six deep)."""
    script = r'''
import os, signal, sys, threading, time
from reshard.service.process.lifecycle import stop_on_signals
signal.signal(signal.SIGTERM, lambda *a: None)  # the "previous" handler: uvicorn's sets a flag
stopping = threading.Event()
calls = []
def stop():
    calls.append(1)
    for _ in range(2000):  # long enough that later signals land inside it
        stopping.set()
stop_on_signals(stop)
def storm():
    for _ in range(3000):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0)  # let the main thread run its handler between signals
t = threading.Thread(target=storm)
t.start()
while t.is_alive():
    time.sleep(0.0001)
print(len(calls))
'''
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"

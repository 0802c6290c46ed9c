"""The workers' shared state database failing under `reshard serve --workers 2` (issue 26, items 5 and 6).

- Its file system full (an ext4 image and a tmpfs, filled to the last block), or its files immutable
  (`chattr +i`): job routes answer 507 / 503 with the usual JSON body, `/digest` and full downloads
  answer complete, correct bytes, each worker logs it once, and everything works again once the cause
  is gone.
- Its file deleted, then one worker SIGKILLed (its replacement starts on a new file): every worker
  answers from the same database, and the server says so in its log.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.format.rank_file import rank_file_name
from tests.support.fs import Mount, mounted
from tests.support.hard import live_server, wait_for, workers
from tests.support.live import LiveServer

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

DB = "state.sqlite3"
FAULT_LOGGED = "job routes answer"  # the line a worker logs when the state database starts failing


def hold_db(srv: LiveServer, db: Path) -> bool:
    """Both workers have `db` open (so both answer from it)."""
    pids = workers(srv)
    return len(pids) == 2 and all(str(db) in _open_files(pid) for pid in pids)


def _open_files(pid: int) -> list[str]:
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def submit(srv: LiveServer, name: str, tp: int) -> httpx.Response:
    return httpx.post(srv.ckpt_url(name) + "/jobs", json={"tp": tp}, timeout=30)


def wait_done(srv: LiveServer, job_id: str, *, out: Path | None = None) -> dict[str, Any]:
    """The job's record once it is done; with `out`, also once OUT/.jobs/state.sqlite3 says so (its worker
    answers "done" from memory a moment before it saves the record: a test that fills or freezes the
    database's file system right after must not meet that save)."""
    last: dict[str, Any] = {}

    def done() -> bool:
        nonlocal last
        last = httpx.get(f"{srv.url}/v1/jobs/{job_id}", timeout=10).json()
        return last.get("state") in ("done", "failed")

    assert wait_for(done, timeout=180), last  # a loaded machine stretches a job; a hang is not this
    assert last["state"] == "done", last
    if out is not None:
        assert wait_for(lambda: saved_state(out / ".jobs" / DB, job_id) == "done", timeout=60), srv.log()
    return last


def saved_state(db: Path, job_id: str) -> str | None:
    """The state of job `job_id` as the database file records it (read-only, as sqlite3 reads it)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        row = conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return row[0] if row else None


def check_data_path(srv: LiveServer, written: Any, name: str) -> None:
    """`/digest` of every rank at tp=4 and two full downloads of every rank at tp=1 (digests not yet
    known anywhere: the downloads compute them as they stream) equal `reshard write`'s files."""
    ref4 = written(name, 4)
    for rank in range(4):
        r = httpx.get(f"{srv.ckpt_url(name)}/shards/{rank}/digest", params={"tp": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["sha256"] == hashlib.sha256((ref4 / rank_file_name(rank, 4)).read_bytes()).hexdigest()
    ref1 = (written(name, 1) / rank_file_name(0, 1)).read_bytes()
    for _ in range(2):  # fresh connections: both workers, the first download of each computing the digest
        r = httpx.get(f"{srv.ckpt_url(name)}/shards/0", params={"tp": 1}, timeout=60)
        assert r.status_code == 200 and r.content == ref1, (r.status_code, len(r.content), len(ref1))


def job_routes_refuse(srv: LiveServer, name: str, status: int, error: str) -> None:
    """POST .../jobs answers `status` with `{"error": error, "detail": ...}`, on both workers."""
    for _ in range(6):
        r = submit(srv, name, 2)
        assert r.status_code == status, r.text
        body = r.json()
        assert sorted(body) == ["detail", "error"] and body["error"] == error, body
        assert DB in body["detail"] and not re.search(r"(^|[\s(])/\w", body["detail"]), body  # no server path


def logged_once(srv: LiveServer) -> None:
    n = srv.log().count(FAULT_LOGGED)
    assert 1 <= n <= 2, srv.log()  # once per worker that met it
    assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(params=["ext4", "tmpfs"])
def state_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mount]:
    with mounted(request.param, tmp_path / "mnt", size_mb=16) as m:
        yield m


def test_full_state_store(state_fs: Mount, ckpt_root: Path, written: Any) -> None:
    """--out (and the state database in OUT/.jobs) on a file system filled to its last block."""
    out = state_fs.path / "out"
    with live_server(ckpt_root, out=out, log_dir=state_fs.path.parent) as srv:
        first = submit(srv, "llama", 2)
        assert first.status_code == 202, first.text
        wait_done(srv, first.json()["id"], out=out)

        state_fs.fill()
        job_routes_refuse(srv, "llama", 507, "StateFullError")
        listed = httpx.get(srv.url + "/v1/jobs", timeout=30)  # reads need no space
        assert listed.status_code == 200 and [j["id"] for j in listed.json()] == [first.json()["id"]], listed.text
        check_data_path(srv, written, "llama")
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200
        logged_once(srv)

        state_fs.unfill()
        again = submit(srv, "llama", 4)
        assert again.status_code == 202, again.text
        job = wait_done(srv, again.json()["id"])
        for rank in range(4):
            name = rank_file_name(rank, 4)
            assert (Path(job["output_dir"]) / name).read_bytes() == (written("llama", 4) / name).read_bytes()
        assert "is writable again" in srv.log(), srv.log()
        assert srv.alive() and "Traceback" not in srv.log(), srv.log()


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Mount]:
    with mounted("ext4", tmp_path / "mnt", size_mb=32) as m:
        yield m


def _chattr(flag: str, files: list[Path]) -> None:
    r = subprocess.run(["chattr", flag, *map(str, files)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"chattr {flag} is not permitted here: {r.stderr.strip()}")


def test_immutable_state_store(ext4: Mount, ckpt_root: Path, written: Any) -> None:
    """The database's files made immutable (`chattr +i`) under a running server, then mutable again.
    No worker dies (a WAL's shared-memory file is mapped: writing a mapped page of an immutable file
    raises SIGBUS, which is why the journal is a rollback journal)."""
    out = ext4.path / "out"
    with live_server(ckpt_root, out=out, log_dir=ext4.path.parent) as srv:
        first = submit(srv, "llama", 2)
        assert first.status_code == 202, first.text
        wait_done(srv, first.json()["id"], out=out)
        files = sorted((out / ".jobs").glob(f"{DB}*"))
        before = workers(srv)
        _chattr("+i", files)
        try:
            job_routes_refuse(srv, "llama", 503, "StateUnavailableError")
            check_data_path(srv, written, "llama")
            assert workers(srv) == before and srv.alive(), srv.log()  # no worker died
            logged_once(srv)
        finally:
            _chattr("-i", files)
        again = submit(srv, "llama", 1)
        assert again.status_code == 202, again.text
        wait_done(srv, again.json()["id"])
        assert "is writable again" in srv.log(), srv.log()
        assert srv.alive() and "Traceback" not in srv.log(), srv.log()


def _poll_all(srv: LiveServer, job_ids: list[str], n: int = 36) -> dict[str, list[int]]:
    """Status codes of `n` GETs of each job, each on a fresh connection (so both workers answer)."""
    return {j: [httpx.get(f"{srv.url}/v1/jobs/{j}", timeout=10).status_code for _ in range(n)] for j in job_ids}


def test_deleted_state_store(ckpt_root: Path, tmp_path: Path) -> None:
    """`rm OUT/.jobs/state.sqlite3`, then one worker SIGKILLed (its replacement opens a new file): the
    workers agree on every job (a job submitted after it answers 200 on all 36 polls; one from before
    answers the same on all), and the log says the database was deleted. Then deleted once more, no
    worker restarted: the same."""
    out = tmp_path / "out"
    with live_server(ckpt_root, out=out, log_dir=tmp_path) as srv:
        old = submit(srv, "phi3", 2)
        assert old.status_code == 202, old.text
        wait_done(srv, old.json()["id"])

        db = out / ".jobs" / DB
        assert wait_for(lambda: hold_db(srv, db), timeout=60), srv.log()
        db.unlink()
        victim, survivor = workers(srv)
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:  # its replacement has opened the new file (the survivor still has the old one)
            fresh = [p for p in workers(srv) if p not in (victim, survivor)]
            return len(fresh) == 1 and str(db) in _open_files(fresh[0])

        assert wait_for(replaced, timeout=60), srv.log()
        assert f"{db} (deleted)" in _open_files(survivor) or str(db) in _open_files(survivor)
        new = submit(srv, "phi3", 4)
        assert new.status_code == 202, new.text
        wait_done(srv, new.json()["id"])
        polls = _poll_all(srv, [new.json()["id"], old.json()["id"]])
        assert polls[new.json()["id"]] == [200] * 36, polls
        assert len(set(polls[old.json()["id"]])) == 1, polls  # lost with the deleted file, but for everyone
        assert "state database" in srv.log() and "deleted" in srv.log(), srv.log()

        (out / ".jobs" / DB).unlink()  # and with no restart
        third = submit(srv, "phi3", 1)
        assert third.status_code == 202, third.text
        wait_done(srv, third.json()["id"])
        assert _poll_all(srv, [third.json()["id"]])[third.json()["id"]] == [200] * 36
        assert json.loads(httpx.get(srv.url + "/v1/jobs", timeout=10).text)[-1]["id"] == third.json()["id"]
        assert srv.alive() and "Traceback" not in srv.log(), srv.log()

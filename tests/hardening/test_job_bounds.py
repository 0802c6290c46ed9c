"""Bounded work per request and per worker (issue 38, findings 2 and 5), against the app itself: a write
job is planned when it starts (queued jobs hold no plan and report no total yet), a worker holds at most
`max_jobs_pending` queued or running jobs (429 JSON beyond, and again 202 once they are done), and a plan
or a job over `max_plan_work` (ranks x tensors) is refused before anything is planned. The reference for
the written bytes: the files `reshard write` writes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from reshard.format.rank_file import rank_file_name
from reshard.service import Settings, create_app
from tests.support.live import make_ckpt

pytestmark = pytest.mark.servers


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    make_ckpt(tmp_path / "root" / "llama")
    settings = Settings(root=tmp_path / "root", out=tmp_path / "out", max_jobs_pending=2, max_plan_work=2000)
    with TestClient(create_app(settings)) as c:
        yield c


def _wait(client: TestClient, job_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in ("done", "failed"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end")


def test_pending_jobs_are_bounded_and_hold_no_plan(client: TestClient, tmp_path: Path) -> None:
    jobs = client.app.state.jobs
    out_dir = tmp_path / "out" / "llama" / "tp-2"
    with jobs._dir_lock(out_dir):  # the output directory busy (as another worker's job holds it): jobs queue
        first = [client.post("/v1/checkpoints/llama/jobs", json={"tp": 2}) for _ in range(2)]
        assert [r.status_code for r in first] == [202, 202], [r.text for r in first]
        assert all(r.json()["bytes_total"] == 0 for r in first)  # not planned yet
        third = client.post("/v1/checkpoints/llama/jobs", json={"tp": 2})
        assert third.status_code == 429 and third.json()["error"] == "TooBusy", third.text
        assert "2 write jobs queued or running" in third.json()["detail"], third.text
    done = [_wait(client, r.json()["id"]) for r in first]
    assert all(j["state"] == "done" and j["bytes_done"] == j["bytes_total"] > 0 for j in done), done
    assert sorted(p.name for p in out_dir.glob("rank-*")) == [rank_file_name(r, 2) for r in range(2)]
    again = client.post("/v1/checkpoints/llama/jobs", json={"tp": 2})
    assert again.status_code == 202 and _wait(client, again.json()["id"])["state"] == "done"


def test_planning_work_is_budgeted_per_request(client: TestClient) -> None:
    count = len(client.get("/v1/checkpoints/llama/plan", params={"tp": 1}).json()["ranks"][0]["tensors"])
    t0 = time.process_time()
    for r in (client.get("/v1/checkpoints/llama/plan", params={"fsdp": 4096, "tensors": "false"}),
              client.post("/v1/checkpoints/llama/jobs", json={"fsdp": 4096})):
        assert r.status_code == 400 and r.json()["error"] == "BadRequest", r.text
        assert f"plans 4096 ranks x {count} tensors = {4096 * count}, over the 2000 one request may plan" in r.json()["detail"]
        assert f"ask for at most {2000 // count} ranks at a time" in r.json()["detail"]
    assert time.process_time() - t0 < 2.0  # refused before planning (planning them takes several CPU-s)
    ok = client.post("/v1/checkpoints/llama/jobs", json={"fsdp": 4096, "ranks": [0, 4095]})
    assert ok.status_code == 202, ok.text

"""Against a real `reshard serve` (uvicorn) on 127.0.0.1: bytes, ranges, jobs, uploads, auth, load."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.format.rank_file import rank_file_name
from reshard.io.client.shard_client import ShardClient
from tests.support.live import (
    BIG,
    REPO,
    SMALL_CKPTS,
    LiveServer,
    live_server,
    metric,
    raw_request,
    sendfile_bytes,
    streams_settled,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

CASES = [(name, tp) for name, (_, tps) in SMALL_CKPTS.items() for tp in tps]


def shard_url(srv: LiveServer, name: str, rank: int) -> str:
    return f"{srv.ckpt_url(name)}/shards/{rank}"


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_shards_identical_to_reshard_write(server: LiveServer, written: Any, name: str, tp: int) -> None:
    out = written(name, tp)
    with httpx.Client(timeout=30) as http:
        for rank in range(tp):
            want = (out / rank_file_name(rank, tp)).read_bytes()
            head = http.head(shard_url(server, name, rank), params={"tp": tp})
            got = http.get(shard_url(server, name, rank), params={"tp": tp})
            assert got.status_code == 200 and got.headers["content-type"] == "application/octet-stream"
            assert int(head.headers["content-length"]) == int(got.headers["content-length"]) == len(want)
            assert head.headers["etag"] == got.headers["etag"]
            assert got.content == want, (name, tp, rank)
    record = json.loads((out / "reshard.json").read_text())
    digest = httpx.get(shard_url(server, name, 0) + "/digest", params={"tp": tp}).json()
    assert digest["sha256"] == record["files"][rank_file_name(0, tp)]["sha256"]


def test_range_etag_416_live(server: LiveServer, written: Any) -> None:
    want = (written(BIG, 8) / rank_file_name(3, 8)).read_bytes()  # ~7 MB: many 256 KiB chunks
    url, params = shard_url(server, BIG, 3), {"tp": 8}
    with httpx.Client() as http:
        etag = http.head(url, params=params).headers["etag"]
        chunk = 256 << 10
        for a, b in [(0, 0), (7, 300_000), (len(want) - 1, len(want) - 1), (chunk - 3, 2 * chunk + 5),
                     (5 * chunk, 6 * chunk - 1), (len(want) - chunk - 1, len(want) + 100)]:
            r = http.get(url, params=params, headers={"Range": f"bytes={a}-{b}", "If-Range": etag})
            assert r.status_code == 206 and r.content == want[a : b + 1]
            assert int(r.headers["content-length"]) == len(want[a : b + 1])
            assert r.headers["content-range"] == f"bytes {a}-{min(b, len(want) - 1)}/{len(want)}"
        r = http.head(url, params=params, headers={"Range": "bytes=10-"})
        assert r.status_code == 206 and int(r.headers["content-length"]) == len(want) - 10
        assert http.get(url, params=params, headers={"If-None-Match": etag}).status_code == 304
        assert http.get(url, params=params, headers={"If-None-Match": '"other"'}).status_code == 200
        r = http.get(url, params=params, headers={"Range": f"bytes={len(want) + 5}-"})
        assert r.status_code == 416 and r.json()["error"] == "RangeNotSatisfiable"


def test_plan_live(server: LiveServer) -> None:
    plan = ShardClient(server.ckpt_url("phi3")).plan(4)
    assert plan["tp"] == 4 and [r["rank"] for r in plan["ranks"]] == [0, 1, 2, 3]
    kinds = {t["name"].split(".")[-2]: t["kind"] for t in plan["ranks"][0]["tensors"]}
    assert kinds["qkv_proj"] == "packed_column" and kinds["down_proj"] == "row"
    head = httpx.head(shard_url(server, "phi3", 3), params={"tp": 4})
    assert plan["ranks"][3]["etag"] == head.headers["etag"]
    assert plan["ranks"][3]["bytes"] == int(head.headers["content-length"])


def test_job_to_completion(server: LiveServer, written: Any) -> None:
    r = httpx.post(server.ckpt_url("qwen2") + "/jobs", json={"tp": 2, "ranks": [1]})
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    deadline = time.monotonic() + 30
    while job["state"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = httpx.get(f"{server.url}/v1/jobs/{job['id']}").json()
    assert job["state"] == "done", job
    assert job["bytes_done"] == job["bytes_total"] > 0 and job["error"] is None
    want = written("qwen2", 2)
    assert [Path(p).name for p in job["outputs"]] == [rank_file_name(1, 2)]
    assert Path(job["outputs"][0]).read_bytes() == (want / rank_file_name(1, 2)).read_bytes()
    record = json.loads((Path(job["output_dir"]) / "reshard.json").read_text())
    assert record["plan"] == job["plan"]
    sha = hashlib.sha256((want / rank_file_name(1, 2)).read_bytes()).hexdigest()
    assert httpx.head(shard_url(server, "qwen2", 1), params={"tp": 2}).headers["x-reshard-sha256"] == sha
    bad = httpx.post(server.ckpt_url("qwen2") + "/jobs", json={"tp": 2, "ranks": [5]})
    assert bad.status_code == 422 and bad.json()["error"] == "PlanError"
    assert metric(server, 'reshard_jobs{state="done"}') >= 1


def test_concurrent_pulls_byte_correct_and_memory_bounded(server: LiveServer, written: Any) -> None:
    pulls = [(BIG, tp, rank) for tp in (1, 2, 4, 8) for rank in range(tp)] + [("llama", 4, 3)]
    assert len(set(pulls)) == 16
    files = {(n, tp, r): written(n, tp) / rank_file_name(r, tp) for n, tp, r in pulls}
    wanted = {key: hashlib.sha256(path.read_bytes()).hexdigest() for key, path in files.items()}
    total = sum(path.stat().st_size for path in files.values())
    rss0 = server.rss()

    def pull(job: tuple[str, int, int]) -> tuple[tuple[str, int, int], str]:
        name, tp, rank = job
        sha = hashlib.sha256()
        with ShardClient(server.ckpt_url(name), verify=False) as client:
            for piece in client.iter_shard(rank, tp):
                sha.update(piece)
        return job, sha.hexdigest()

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(pull, pulls))
    for job, sha in results:
        assert sha == wanted[job], job
    growth = server.peak_rss() - rss0
    print(f"server RSS growth {growth / 2**20:.1f} MiB for {total / 2**20:.0f} MiB pulled")
    # 16 streams x ~3 chunks of 256 KiB, plus allocator slack: far below the 16 shards (~190 MB)
    assert growth < min(96 << 20, total // 2), (growth, total)
    assert metric(server, "reshard_active_streams") == 0


def test_contiguous_ranges_go_out_by_sendfile(server: LiveServer, ckpt_root: Path, written: Any) -> None:
    """Once a shard's digest is known, its contiguous source ranges are sent by the kernel (whole
    bodies and ranges alike), with the same bytes; `--no-zero-copy` sends none that way."""
    # new mtimes, so no copy of gathered pieces (reshard.service.transport.gathered) from earlier pulls serves this one
    shutil.copytree(ckpt_root / BIG, ckpt_root / "fresh-sendfile", copy_function=shutil.copyfile)
    want = (written(BIG, 2) / rank_file_name(1, 2)).read_bytes()
    url, params = shard_url(server, "fresh-sendfile", 1), {"tp": 2}
    httpx.get(url + "/digest", params=params, timeout=60)
    expected = sendfile_bytes(ckpt_root / BIG, 2, 1, 0, len(want))
    assert expected > len(want) // 2
    before = metric(server, "reshard_shard_bytes_sendfile_total")
    assert httpx.get(url, params=params, timeout=60).content == want
    assert metric(server, "reshard_shard_bytes_sendfile_total") - before == expected
    a, b = 123_457, len(want) - 99_999  # both ends inside sendfile ranges or copied pieces alike
    before = metric(server, "reshard_shard_bytes_sendfile_total")
    r = httpx.get(url, params=params, headers={"Range": f"bytes={a}-{b}"}, timeout=60)
    assert r.status_code == 206 and r.content == want[a : b + 1]
    assert metric(server, "reshard_shard_bytes_sendfile_total") - before == sendfile_bytes(ckpt_root / BIG, 2, 1, a, b + 1)
    with live_server(ckpt_root, zero_copy=False) as copying:
        curl = httpx.get(shard_url(copying, BIG, 1), params=params, timeout=60)
        assert curl.content == want
        assert httpx.get(shard_url(copying, BIG, 1), params=params, timeout=60).content == want
        assert metric(copying, "reshard_shard_bytes_sendfile_total") == 0
        assert metric(copying, "reshard_shard_bytes_served_total") == 2 * len(want)


def test_first_download_fills_the_digest_cache(server: LiveServer, ckpt_root: Path, written: Any) -> None:
    """A client's first pull of a shard is verified without the server streaming the shard a second
    time: the download itself computed the sha256 the client then asks for."""
    # new mtimes: a copy keeping them would share the original's ETag, whose digest may be cached already
    shutil.copytree(ckpt_root / "llama", ckpt_root / "fresh-digest", copy_function=shutil.copyfile)
    want = (written("llama", 2) / rank_file_name(1, 2)).read_bytes()
    miss0 = metric(server, 'reshard_shard_digests_total{cache="miss"}')
    hit0 = metric(server, 'reshard_shard_digests_total{cache="hit"}')
    with ShardClient(server.ckpt_url("fresh-digest")) as client:
        assert client.read_shard(1, 2) == want  # raises IntegrityError unless the sha256 matches
    assert metric(server, 'reshard_shard_digests_total{cache="miss"}') == miss0
    assert metric(server, 'reshard_shard_digests_total{cache="hit"}') == hit0 + 1
    head = httpx.head(shard_url(server, "fresh-digest", 1), params={"tp": 2})
    assert head.headers["x-reshard-sha256"] == hashlib.sha256(want).hexdigest()


@pytest.mark.parametrize("path", ["hashing", "sendfile"])
def test_client_disconnect_mid_stream(server: LiveServer, ckpt_root: Path, path: str) -> None:
    """Clients that hang up mid-body: the stream ends, its files close. A fresh copy's digest is
    unknown, so its body is read and hashed; with the digest asked for first, it goes out by sendfile."""
    name = f"disconnect-{path}"
    if not (ckpt_root / name).exists():  # new mtimes: its own ETag, no digest known
        shutil.copytree(ckpt_root / BIG, ckpt_root / name, copy_function=shutil.copyfile)
    target = f"/v1/checkpoints/{name}/shards/0?tp=1"
    if path == "sendfile":
        assert httpx.get(server.url + target.replace("?", "/digest?"), timeout=60).status_code == 200
    sendfile0 = metric(server, "reshard_shard_bytes_sendfile_total")
    streams0 = metric(server, 'reshard_shard_streams_total{outcome="disconnected"}')
    for _ in range(3):
        got = raw_request(server, target, read=1 << 20)
        assert got.startswith(b"HTTP/1.1 200")
    assert streams_settled(server)
    assert metric(server, 'reshard_shard_streams_total{outcome="disconnected"}') == streams0 + 3
    assert httpx.get(server.url + "/healthz").status_code == 200
    full = httpx.get(server.url + target, timeout=60)
    assert full.status_code == 200 and len(full.content) == int(full.headers["content-length"])
    assert (metric(server, "reshard_shard_bytes_sendfile_total") > sendfile0) == (path == "sendfile")
    fds = server.fds()
    assert fds < 64, fds  # source files closed, not leaked per aborted stream


def test_source_changing_mid_stream_cuts_the_body(server: LiveServer, ckpt_root: Path) -> None:
    shutil.copytree(ckpt_root / BIG, ckpt_root / "changing")
    weights = ckpt_root / "changing" / "model.safetensors"
    errors0 = metric(server, 'reshard_shard_streams_total{outcome="error"}')
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET /v1/checkpoints/changing/shards/0?tp=1 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        got = s.recv(1 << 20)
        head, _, body = got.partition(b"\r\n\r\n")
        size = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new identity mid-stream
        received = len(body)
        while chunk := s.recv(1 << 20):
            received += len(chunk)
    assert received < size  # cut short: never a body that mixes two versions
    assert metric(server, 'reshard_shard_streams_total{outcome="error"}') == errors0 + 1
    assert httpx.get(server.url + "/healthz").status_code == 200
    r = httpx.get(server.ckpt_url("changing") + "/shards/0", params={"tp": 1}, timeout=60)
    assert r.status_code == 200 and len(r.content) == size
    shutil.rmtree(ckpt_root / "changing")


@pytest.mark.parametrize("target", [
    "/v1/checkpoints/../../etc/passwd", "/v1/checkpoints/..%2F..%2Fetc/plan?tp=1", "/v1/checkpoints/%2e%2e/plan?tp=1",
    "/v1/checkpoints/llama/../../../etc/passwd", "/v1/checkpoints/%2Fetc%2Fpasswd?tp=1",
    "/v1/checkpoints/llama/files/..%2F..%2Fx.safetensors",
])
def test_raw_path_escapes(server: LiveServer, target: str) -> None:
    status = int(raw_request(server, target).split(b" ", 2)[1])
    assert 400 <= status < 500, (target, status)
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_upload_live(server: LiveServer, ckpt_root: Path, written: Any) -> None:
    src = ckpt_root / "llama" / "model.safetensors"
    data = src.read_bytes()

    def body(blob: bytes, step: int = 100_000) -> Any:
        for i in range(0, len(blob), step):
            yield blob[i : i + step]

    url = server.ckpt_url("uploaded") + "/files/"
    r = httpx.put(url + "config.json", content=(ckpt_root / "llama" / "config.json").read_bytes())
    assert r.status_code == 201, r.text
    r = httpx.put(url + "model.safetensors", content=body(data[: len(data) // 2]))  # chunked, truncated
    assert r.status_code == 422 and r.json()["error"] == "HeaderError"
    assert sorted(p.name for p in (ckpt_root / "uploaded").iterdir()) == ["config.json"]
    r = httpx.put(url + "model.safetensors", content=body(data))
    assert r.status_code == 201 and r.json()["sha256"] == hashlib.sha256(data).hexdigest()
    got = httpx.get(shard_url(server, "uploaded", 1), params={"tp": 2}).content
    assert got == (written("llama", 2) / rank_file_name(1, 2)).read_bytes()


def test_auth_live(ckpt_root: Path, tmp_path: Path, server_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with server_factory(ckpt_root, token="t0ken", out=tmp_path / "out", max_upload_bytes=1000) as srv:
        assert httpx.get(srv.url + "/healthz").status_code == 200
        for path in ("/v1/checkpoints", "/metrics", "/v1/checkpoints/llama/shards/0?tp=1", "/v1/jobs/x"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"] == "Unauthorized"
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(srv.url + "/v1/checkpoints", headers=srv.headers()).status_code == 200
        from reshard.errors import ReshardError

        with pytest.raises(ReshardError, match="401"):
            ShardClient(srv.ckpt_url("llama"), token="nope").info()
        monkeypatch.setenv("RESHARD_TOKEN", "t0ken")
        assert len(ShardClient(srv.ckpt_url("llama")).read_shard(0, 2)) > 0
        # the upload limit comes from settings (here via RESHARD_MAX_UPLOAD_BYTES); chunked bodies too
        big = httpx.put(srv.ckpt_url("x") + "/files/model.safetensors", content=iter([bytes(600)] * 3),
                        headers=srv.headers())
        assert big.status_code == 413, big.text
        assert not (ckpt_root / "x").exists()
        assert srv.alive()


def test_port_in_use_exits_3_and_says_why(server: LiveServer, ckpt_root: Path) -> None:
    port = server.url.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "reshard.cli", "serve", "--root", str(ckpt_root), "--host", "127.0.0.1",
                           "--port", port], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.splitlines() == [f"reshard: error: serve: port {port} on 127.0.0.1 is in use (another reshard "
                                        "serve?); pick a free one with --port N (or RESHARD_PORT), or stop what holds it"]
    assert httpx.get(server.url + "/healthz").status_code == 200  # the first server is untouched

"""Unit tests of the app through TestClient: errors, names and paths, manifests, uploads, auth, docs."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.plan.types import plan_to_json
from reshard.service import Settings, create_app
from reshard.service.transport.ranges import parse_range

pytestmark = [pytest.mark.pure, pytest.mark.timeout(120)]


@pytest.fixture
def root(tmp_path: Path, ckpt_factory: Any) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    ckpt_factory(root / "tiny")
    return root


@pytest.fixture
def client(root: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(root=root, max_upload_bytes=2 << 20)), raise_server_exceptions=True) as c:
        yield c


def _error(r: Any, status: int, error: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error", "detail"}, body
    assert isinstance(body["detail"], str) and body["detail"]
    if error:
        assert body["error"] == error, body
    return body


def test_healthz_and_listing(client: TestClient, root: Path) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    (root / "empty").mkdir()
    (root / ".hidden").mkdir()
    listed = client.get("/v1/checkpoints").json()["checkpoints"]
    assert [c["name"] for c in listed] == ["tiny"]
    assert listed[0]["bytes"] == (root / "tiny" / "model.safetensors").stat().st_size


def test_describe(client: TestClient, root: Path) -> None:
    body = client.get("/v1/checkpoints/tiny").json()
    ckpt, manifest = open_source(root / "tiny")
    assert [f["name"] for f in body["files"]] == ["model.safetensors"]
    tensors = {t["name"]: t for t in body["tensors"]}
    assert set(tensors) == set(ckpt.tensors)
    emb = tensors["model.embed_tokens.weight"]
    assert (emb["dtype"], emb["shape"], emb["bytes"]) == ("F32", [256, 64], 256 * 64 * 4)
    assert body["config"]["model_type"] == "llama"
    assert body["rules"]["source"] == manifest.source and body["rules"]["digest"] == manifest.digest()
    assert body["total_bytes"] == ckpt.total_bytes()


def test_plan_equals_library(client: TestClient, root: Path) -> None:
    ckpt, manifest = open_source(root / "tiny")
    want = plan_to_json(make_plan(ckpt, manifest, 2))
    got = client.get("/v1/checkpoints/tiny/plan", params={"tp": 2}).json()
    for rank in got["ranks"]:
        assert rank.pop("etag").startswith('"')
    assert got == want
    short = client.get("/v1/checkpoints/tiny/plan", params={"tp": 2, "tensors": "false"}).json()
    assert short["ranks"][0]["tensors"] == len(want["ranks"][0]["tensors"])


def test_bad_input_is_4xx_json(client: TestClient) -> None:
    _error(client.get("/nope"), 404, "NotFound")
    _error(client.delete("/v1/checkpoints/tiny"), 405, "MethodNotAllowed")
    _error(client.get("/v1/checkpoints/missing"), 404, "NotFoundError")
    assert client.get("/v1/checkpoints/tiny/plan").json() == client.get("/v1/checkpoints/tiny/plan",
                                                                         params={"tp": 1}).json()  # tp defaults to 1
    _error(client.get("/v1/checkpoints/tiny/plan", params={"pp": 0}), 422, "ValidationError")
    _error(client.get("/v1/checkpoints/tiny/plan", params={"tp": "two"}), 422, "ValidationError")
    _error(client.get("/v1/checkpoints/tiny/plan", params={"tp": 0}), 422, "ValidationError")
    _error(client.get("/v1/checkpoints/tiny/plan", params={"tp": 3}), 422, "PlanError")
    _error(client.get("/v1/checkpoints/tiny/shards/2", params={"tp": 2}), 422, "PlanError")
    _error(client.get("/v1/checkpoints/tiny/shards/-1", params={"tp": 2}), 422, "ValidationError")
    _error(client.post("/v1/checkpoints/tiny/jobs", json={"tp": "x"}), 422, "ValidationError")
    _error(client.post("/v1/checkpoints/tiny/jobs", content=b"{not json", headers={"content-type": "application/json"}),
           422, "ValidationError")
    _error(client.get("/v1/jobs/does-not-exist"), 404, "NotFoundError")
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("path", [
    "/v1/checkpoints/%2E%2E/plan?tp=1", "/v1/checkpoints/.reshard?tp=1", "/v1/checkpoints/..%2F..%2Fetc/plan?tp=1",
    "/v1/checkpoints/%2Fetc/plan?tp=1", "/v1/checkpoints/a%5Cb/plan?tp=1", "/v1/checkpoints/tiny%00/plan?tp=1",
    "/v1/checkpoints/..?tp=1", "/v1/checkpoints/-x/plan?tp=1",
])
def test_path_escapes_refused(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code in (400, 404), (path, r.status_code, r.text)
    assert set(r.json()) == {"error", "detail"}


def test_symlinks_leaving_root_refused(client: TestClient, root: Path, tmp_path: Path, ckpt_factory: Any) -> None:
    outside = ckpt_factory(tmp_path / "outside")
    os.symlink(outside, root / "escape")
    _error(client.get("/v1/checkpoints/escape"), 400, "BadRequest")
    _error(client.get("/v1/checkpoints/escape/shards/0", params={"tp": 1}), 400)
    (root / "sneaky").mkdir()
    os.symlink(outside / "model.safetensors", root / "sneaky" / "model.safetensors")
    _error(client.get("/v1/checkpoints/sneaky"), 400, "BadRequest")
    os.symlink(root / "tiny", root / "alias")  # a link that stays inside the root is fine
    assert client.get("/v1/checkpoints/alias").status_code == 200
    assert [c["name"] for c in client.get("/v1/checkpoints").json()["checkpoints"]] == ["alias", "tiny"]


def test_store_rules_and_select(client: TestClient) -> None:
    etag0 = client.head("/v1/checkpoints/tiny/shards/0", params={"tp": 2}).headers["etag"]
    everything_replicated = {"rules": [{"pattern": "*", "kind": "replicate"}]}
    r = client.put("/v1/checkpoints/tiny/rules", params={"label": "rep"}, json=everything_replicated)
    assert r.status_code == 200, r.text
    assert r.json()["label"] == "rep"
    plan = client.get("/v1/checkpoints/tiny/plan", params={"tp": 2, "rules": "rep"}).json()
    assert {t["kind"] for t in plan["ranks"][1]["tensors"]} == {"replicate"}
    assert client.get("/v1/checkpoints/tiny").json()["rules"]["stored"] == ["rep"]
    # the default label takes precedence over config.json, and changes the ETag
    r = client.put("/v1/checkpoints/tiny/rules", json={"rules": [{"pattern": "*.mlp.*", "kind": "column"}]})
    assert r.status_code == 200, r.text
    assert client.get("/v1/checkpoints/tiny").json()["rules"]["source"] == "stored manifest 'default'"
    etag1 = client.head("/v1/checkpoints/tiny/shards/0", params={"tp": 2}).headers["etag"]
    assert etag1 != etag0
    _error(client.get("/v1/checkpoints/tiny/plan", params={"tp": 2, "rules": "nope"}), 404)
    _error(client.get("/v1/checkpoints/tiny/plan", params={"tp": 2, "rules": "../x"}), 400)


def test_store_rules_validated(client: TestClient, root: Path) -> None:
    _error(client.put("/v1/checkpoints/tiny/rules", json={"rules": [{"pattern": "*", "kind": "nope"}]}), 422)
    _error(client.put("/v1/checkpoints/tiny/rules", json={"rules": [{"kind": "row"}]}), 422, "ManifestError")
    _error(client.put("/v1/checkpoints/tiny/rules", json={"rulez": []}), 422, "ValidationError")
    # fine for tp=1, but hidden 64 is not divisible by 3
    _error(client.put("/v1/checkpoints/tiny/rules", params={"tp": 3},
                      json={"rules": [{"pattern": "*.q_proj.weight", "kind": "column"}]}), 422, "PlanError")
    _error(client.put("/v1/checkpoints/missing/rules", json={"rules": []}), 404)
    assert not (root / ".reshard" / "rules" / "tiny").exists()


def test_json_bodies_are_capped(root: Path) -> None:
    with TestClient(create_app(Settings(root=root, max_body_bytes=1000))) as c:
        big = {"rules": [{"pattern": f"x{i}", "kind": "replicate"} for i in range(100)]}
        _error(c.put("/v1/checkpoints/tiny/rules", json=big), 413, "PayloadTooLarge")
        chunked = iter([json.dumps(big).encode()[i : i + 100] for i in range(0, len(json.dumps(big)), 100)])
        r = c.put("/v1/checkpoints/tiny/rules", content=chunked, headers={"content-type": "application/json"})
        _error(r, 413)
        _error(c.post("/v1/checkpoints/tiny/jobs", json={"tp": 1, "ranks": [0] * 600}), 413)
        assert c.put("/v1/checkpoints/tiny/rules", json={"rules": []}).status_code == 200
        assert c.put("/v1/checkpoints/tiny/files/config.json", content=b"{}" + b" " * 5000).status_code == 200


def _safetensors_bytes(n: int = 16) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(4 * n)


def test_upload_accepted_and_served(client: TestClient, root: Path) -> None:
    data = _safetensors_bytes()
    r = client.put("/v1/checkpoints/fresh/files/model.safetensors", content=data)
    assert r.status_code == 201, r.text
    assert r.json()["size"] == len(data) and r.json()["tensors"] == 1
    assert (root / "fresh" / "model.safetensors").read_bytes() == data
    r = client.put("/v1/checkpoints/fresh/files/model.safetensors", content=data)
    assert r.status_code == 200 and r.json()["replaced"]
    r = client.put("/v1/checkpoints/fresh/rules", json={"rules": [{"pattern": "w", "kind": "column"}]})
    assert r.status_code == 200, r.text
    shard = client.get("/v1/checkpoints/fresh/shards/1", params={"tp": 2})
    assert shard.status_code == 200 and shard.content.endswith(bytes(32))


@pytest.mark.parametrize("body,filename,status", [
    (_safetensors_bytes()[:-4], "model.safetensors", 422),          # truncated data
    (b"\xff" * 64, "model.safetensors", 422),                        # absurd header length
    (b"{not json", "config.json", 422),
    (b'{"weight_map": {"a": "../x.safetensors"}}', "model.safetensors.index.json", 422),
    (b"x", "evil.py", 400),
    (b"x", "..%2Fmodel.safetensors", 404),
    (bytes(3 << 20), "big.safetensors", 413),
])
def test_corrupt_upload_publishes_nothing(client: TestClient, root: Path, body: bytes, filename: str,
                                          status: int) -> None:
    before = {p: p.read_bytes() for p in (root / "tiny").iterdir()}
    r = client.put(f"/v1/checkpoints/tiny/files/{filename}", content=body)
    assert r.status_code == status, r.text
    assert str(root) not in r.text and ".upload-" not in r.text  # details name the upload, not server paths
    assert {p: p.read_bytes() for p in (root / "tiny").iterdir()} == before  # no temp file left either
    r = client.put(f"/v1/checkpoints/brand-new/files/{filename}", content=body)
    assert r.status_code == status
    assert not (root / "brand-new").exists()
    assert client.get("/v1/checkpoints/tiny").status_code == 200


def test_shard_headers_range_304_416(client: TestClient, root: Path, tmp_path: Path) -> None:
    from reshard.cli import main

    assert main(["write", str(root / "tiny"), "--tp", "2", "-o", str(tmp_path / "w"), "--no-progress"]) == 0
    want = (tmp_path / "w" / "rank-00001-of-00002.safetensors").read_bytes()
    url, params = "/v1/checkpoints/tiny/shards/1", {"tp": 2}
    head = client.head(url, params=params)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(want)
    assert head.headers["accept-ranges"] == "bytes"
    full = client.get(url, params=params)
    assert full.content == want and full.headers["etag"] == head.headers["etag"]
    assert "x-reshard-sha256" not in head.headers and "x-reshard-sha256" not in full.headers
    etag = full.headers["etag"]
    part = client.get(url, params=params, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == want[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{len(want)}"
    assert client.get(url, params=params, headers={"Range": "bytes=-10"}).content == want[-10:]
    assert client.get(url, params=params, headers={"Range": "bytes=5-", "If-Range": etag}).content == want[5:]
    stale = client.get(url, params=params, headers={"Range": "bytes=5-", "If-Range": '"old"'})
    assert stale.status_code == 200 and stale.content == want
    assert client.get(url, params=params, headers={"Range": "bytes=1-2,5-6"}).status_code == 200
    assert client.get(url, params=params, headers={"If-None-Match": etag}).status_code == 304
    r = client.get(url, params=params, headers={"Range": f"bytes={len(want)}-"})
    assert _error(r, 416, "RangeNotSatisfiable") and r.headers["content-range"] == f"bytes */{len(want)}"
    # the full download hashed what it read: the digest is known without streaming the shard again
    assert client.head(url, params=params).headers["x-reshard-sha256"] == hashlib.sha256(want).hexdigest()
    digest = client.get(url + "/digest", params=params).json()
    assert digest["sha256"] == hashlib.sha256(want).hexdigest() and digest["cached"]


def test_digest_computed_once_when_no_full_download(client: TestClient, root: Path, tmp_path: Path) -> None:
    """Ranges, HEAD and a 304 do not fill the digest cache; `.../digest` streams the shard once."""
    from reshard.cli import main

    assert main(["write", str(root / "tiny"), "--tp", "2", "-o", str(tmp_path / "w"), "--no-progress"]) == 0
    want = (tmp_path / "w" / "rank-00000-of-00002.safetensors").read_bytes()
    url, params = "/v1/checkpoints/tiny/shards/0", {"tp": 2}
    etag = client.head(url, params=params).headers["etag"]
    assert client.get(url, params=params, headers={"Range": "bytes=0-"}).content == want  # a range, not a full GET
    assert client.get(url, params=params, headers={"If-None-Match": etag}).status_code == 304
    assert "x-reshard-sha256" not in client.head(url, params=params).headers
    digest = client.get(url + "/digest", params=params).json()
    assert digest["sha256"] == hashlib.sha256(want).hexdigest() and not digest["cached"]
    assert client.get(url + "/digest", params=params).json()["cached"]
    assert client.get(url, params=params).headers["x-reshard-sha256"] == digest["sha256"]


@pytest.mark.parametrize("header,size,want", [
    ("bytes=0-9", 100, (0, 10)), ("bytes=90-", 100, (90, 100)), ("bytes=-5", 100, (95, 100)),
    ("bytes=-500", 100, (0, 100)), ("bytes=10-1000", 100, (10, 100)), ("bytes=9-3", 100, None),
    ("items=0-1", 100, None), ("bytes=0-1,3-4", 100, None), (None, 100, None), ("bytes=-", 100, None),
])
def test_parse_range(header: str | None, size: int, want: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == want


def test_auth(root: Path) -> None:
    app = create_app(Settings(root=root, token="s3cret"))
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        for path in ("/v1/checkpoints", "/v1/checkpoints/tiny", "/metrics", "/docs", "/openapi.json", "/nope",
                     "/v1/checkpoints/tiny/shards/0?tp=1"):
            r = c.get(path)
            _error(r, 401, "Unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
            _error(c.get(path, headers={"Authorization": "Bearer wrong"}), 401)
            _error(c.get(path, headers={"Authorization": "Basic s3cret"}), 401)
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/checkpoints", headers=ok).status_code == 200
        assert c.get("/v1/checkpoints", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert "bearer" in json.dumps(c.get("/openapi.json", headers=ok).json()["components"]).lower()
    with TestClient(create_app(Settings(root=root, token="s3cret", public_docs=True))) as c:
        assert c.get("/docs").status_code == 200 and c.get("/v1/checkpoints").status_code == 401


def test_openapi_describes_everything(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    ops = {(p, m) for p, item in spec["paths"].items() for m in item}
    for want in [("/healthz", "get"), ("/v1/checkpoints", "get"), ("/v1/checkpoints/{name}", "get"),
                 ("/v1/checkpoints/{name}/rules", "put"), ("/v1/checkpoints/{name}/files/{filename}", "put"),
                 ("/v1/checkpoints/{name}/plan", "get"), ("/v1/checkpoints/{name}/shards/{rank}", "get"),
                 ("/v1/checkpoints/{name}/shards/{rank}", "head"), ("/v1/checkpoints/{name}/shards/{rank}/digest", "get"),
                 ("/v1/checkpoints/{name}/jobs", "post"), ("/v1/jobs/{job_id}", "get"), ("/metrics", "get")]:
        assert want in ops, want
    shard = spec["paths"]["/v1/checkpoints/{name}/shards/{rank}"]["get"]
    assert {"200", "206", "304", "416"} <= set(shard["responses"])
    assert "application/octet-stream" in shard["responses"]["200"]["content"]
    assert client.get("/docs").status_code == 200


def test_metrics_exposition(client: TestClient) -> None:
    client.get("/v1/checkpoints/tiny/shards/0", params={"tp": 2})
    client.get("/v1/checkpoints/missing")
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in r.text.splitlines():  # every sample line is `name{labels} number`
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    assert samples['reshard_http_requests_total{method="GET",route="/v1/checkpoints/{name}/shards/{rank}",status="200"}'] == 1
    assert samples['reshard_http_requests_total{method="GET",route="/v1/checkpoints/{name}",status="404"}'] == 1
    assert samples["reshard_active_streams"] == 0
    assert samples['reshard_shard_streams_total{outcome="complete"}'] == 1
    assert samples["reshard_stream_duration_seconds_count"] == 1
    assert samples['reshard_jobs{state="done"}'] == 0
    size = int(client.head("/v1/checkpoints/tiny/shards/0", params={"tp": 2}).headers["content-length"])
    assert samples["reshard_shard_bytes_served_total"] == size
    assert not any(k.endswith("_created") for k in samples)


def test_settings_env_and_flags(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reshard.cli import build_parser
    from reshard.cli.serve import _settings

    monkeypatch.setenv("RESHARD_ROOT", str(root))
    monkeypatch.setenv("RESHARD_TOKEN", "from-env")
    monkeypatch.setenv("RESHARD_CHUNK_SIZE", str(1 << 20))
    s = Settings()  # type: ignore[call-arg]
    assert (s.root, s.token.get_secret_value() if s.token else None, s.chunk_size) == (root.resolve(), "from-env", 1 << 20)
    assert s.out_dir == root.resolve() / ".reshard" / "out"
    args = build_parser().parse_args(["serve", "--port", "9999", "--token", "flag", "--out", str(tmp_path / "o")])
    s = _settings(args)
    assert (s.port, s.token.get_secret_value(), s.chunk_size, s.out_dir) == (9999, "flag", 1 << 20, tmp_path / "o")
    from reshard.errors import ReshardError

    with pytest.raises(ReshardError, match="root"):
        _settings(build_parser().parse_args(["serve", "--root", str(tmp_path / "missing")]))

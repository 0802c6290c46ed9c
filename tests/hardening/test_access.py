"""Access: with a token, every route but /healthz (uploads and jobs included) refuses a missing or wrong
token with a 401 JSON answer and touches nothing; the token never shows in logs, answers or CLI errors;
uploads and job outputs never land outside their directories, whatever the names say."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.hard import raw_http, tree, verbose_server, wait_for
from tests.support.live import LiveServer, make_ckpt

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

TOKEN = "tok-7f3a-SECRET-91c2"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
WRONG = [
    {"Authorization": f"Bearer {TOKEN[:-1]}x"},
    {"Authorization": f"Bearer {TOKEN.upper()}"},
    {"Authorization": f"Bearer {TOKEN}{TOKEN}"},
    {"Authorization": f"Bearer  {TOKEN}"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
    {"Authorization": "Bearer"},
    {"X-Token": TOKEN},
]
EXTRA_PATHS = ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/nope", "/v1", "/metrics/",
               "/v1/checkpoints/llama/shards/0/digest?tp=1", "/healthz/../metrics", "//metrics"]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("access")
    root, out, outside = base / "root", base / "out", base / "outside"
    make_ckpt(root / "llama", vocab_size=250, num_key_value_heads=4)
    make_ckpt(outside / "ckpt", vocab_size=250, num_key_value_heads=4)
    os.symlink(outside / "ckpt", root / "outlink")  # a checkpoint directory that leaves the root
    (root / "inner").mkdir()
    os.symlink(outside / "ckpt" / "model.safetensors", root / "inner" / "model.safetensors")
    with verbose_server(root, token=TOKEN, out=out, log_path=base / "server.log") as srv:
        yield {"srv": srv, "root": root, "out": out, "outside": outside, "base": base, "answers": []}
        assert srv.alive()
    log = (base / "server.log").read_text(errors="replace")
    assert len(log) > 10_000 and "Traceback" not in log, log[-3000:]
    assert TOKEN not in log, "the token is in the server log"
    assert TOKEN.upper() not in log and TOKEN[:-1] not in log


def _operations(srv: LiveServer) -> list[tuple[str, str, dict[str, Any]]]:
    spec = httpx.get(srv.url + "/openapi.json", headers=GOOD).json()
    ops = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            params = {p["name"] for p in op.get("parameters", [])}
            url = path.format(name="llama", rank=0, job_id="0" * 32, filename="config.json", part="optimizer")
            kw: dict[str, Any] = {"params": {"tp": 1} if "tp" in params else {}}
            if method == "put" and path.endswith("/rules"):
                kw["json"] = {"rules": [{"pattern": "*", "kind": "replicate"}]}
                kw["params"]["label"] = "access"
            elif method == "put":  # an upload: into a new directory, so `llama` stays as it is
                url = path.format(name="uploaded", filename="config.json")
                kw["content"] = json.dumps({"model_type": "llama"}).encode()
            elif method == "post" and "/boxes" in path:
                kw["json"] = {"boxes": [{"name": "model.norm.weight", "offsets": [0], "sizes": [1]}]}
            elif method == "post":
                kw["json"] = {"tp": 1}
            ops.append((method.upper(), url, kw))
    return ops


def _record(guarded: dict[str, Any], r: httpx.Response) -> httpx.Response:
    guarded["answers"].append(str(r.headers) + r.text)
    return r


def test_every_route_needs_the_token(guarded: dict[str, Any]) -> None:
    srv, root, out = guarded["srv"], guarded["root"], guarded["out"]
    ops = _operations(srv)
    assert len(ops) == 23 and {"PUT", "POST", "HEAD"} <= {m for m, _, _ in ops}
    before = tree(root), tree(out) if out.exists() else {}
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for method, url, kw in ops:
            if url == "/healthz":
                assert _record(guarded, http.request(method, url)).status_code == 200
                continue
            for headers in [{}, *WRONG]:
                r = _record(guarded, http.request(method, url, headers=headers, **kw))
                assert r.status_code == 401, (method, url, headers, r.status_code, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                if method != "HEAD":
                    body = r.json()
                    assert body["error"] == "Unauthorized", body
                    assert ("missing" if not headers.get("Authorization") else "wrong") in body["detail"], body
        for path in EXTRA_PATHS:
            for headers in [{}, WRONG[0]]:
                assert _record(guarded, http.get(path, headers=headers)).status_code == 401, path
        after = tree(root), tree(out) if out.exists() else {}
        assert after == before, "a refused request changed the disk"
        for method, url, kw in ops:  # the right token opens every door
            r = _record(guarded, http.request(method, url, headers=GOOD, **kw))
            assert r.status_code not in (401, 403) and r.status_code < 500, (method, url, r.status_code, r.text)
        assert _record(guarded, http.get("/docs", headers=GOOD)).status_code == 200
        job_ids = [j["id"] for j in http.get("/v1/jobs", headers=GOOD).json()]
        assert wait_for(lambda: all(http.get(f"/v1/jobs/{i}", headers=GOOD).json()["state"] == "done" for i in job_ids))
    for answer in guarded["answers"]:
        assert TOKEN not in answer and TOKEN[:-1] not in answer


def test_cli_errors_do_not_show_the_token(guarded: dict[str, Any], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.cli import main

    srv = guarded["srv"]
    secret = "my-own-s3cret-value"
    for token in (secret, TOKEN[:-1] + "x"):
        rc = main(["pull", srv.ckpt_url("llama"), "--rank", "0", "--tp", "1", "--token", token,
                   "-o", str(tmp_path / "x.safetensors"), "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 1 and len(err.splitlines()) == 1 and "HTTP 401 Unauthorized: wrong bearer token" in err, err
        assert token not in err and TOKEN[:-1] not in err
    assert list(tmp_path.iterdir()) == []


def _safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + bytes(16)


# raw request targets (sent as written: dot segments and escapes reach the server) -> expected status
ESCAPES = {
    "/v1/checkpoints/llama/files/../x.safetensors": 404,
    "/v1/checkpoints/llama/files/..%2fx.safetensors": 404,
    "/v1/checkpoints/llama/files/..%2f..%2f..%2fx.safetensors": 404,
    "/v1/checkpoints/llama/files/%2ftmp%2fx.safetensors": 404,
    "/v1/checkpoints/llama/files/.x.safetensors": 400,
    "/v1/checkpoints/llama/files/x%00.safetensors": 400,
    "/v1/checkpoints/llama/files/%2e%2e": 400,
    "/v1/checkpoints/../files/x.safetensors": 400,
    "/v1/checkpoints/%2e%2e/files/x.safetensors": 400,
    "/v1/checkpoints/..%2foutside/files/x.safetensors": 404,
    "/v1/checkpoints/.reshard/files/x.safetensors": 400,
    "/v1/checkpoints/outlink/files/x.safetensors": 400,  # a symlinked directory that leaves the root
    "/v1/checkpoints/outlink/files/model.safetensors": 400,
}


def test_uploads_stay_inside_the_root(guarded: dict[str, Any]) -> None:
    srv, root, base, outside = guarded["srv"], guarded["root"], guarded["base"], guarded["outside"]
    body = _safetensors()
    outside_before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    before = tree(base)
    for target, status in ESCAPES.items():
        head = (f"PUT {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}")
        got, answer = raw_http(srv, head, body)
        assert got == status, (target, answer[-300:])
        assert TOKEN.encode() not in answer
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == outside_before
    new = set(tree(base)) - set(before)
    assert all(n == "server.log" for n in new), new
    # a symlinked file inside a checkpoint: the upload replaces the link, never the file it points to
    r = httpx.put(srv.ckpt_url("inner") + "/files/model.safetensors", content=body, headers=GOOD)
    assert r.status_code == 200 and r.json()["replaced"], r.text
    assert not (root / "inner" / "model.safetensors").is_symlink()
    assert (root / "inner" / "model.safetensors").read_bytes() == body
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == outside_before
    assert not any(n.startswith(".upload-") for n in tree(root))


def test_job_outputs_stay_inside_the_out_dir(guarded: dict[str, Any]) -> None:
    srv, out, base = guarded["srv"], guarded["out"], guarded["base"]
    outside_before = tree(guarded["outside"])
    refused = {
        "/v1/checkpoints/../jobs": (400, {"tp": 1}),
        "/v1/checkpoints/%2e%2e/jobs": (400, {"tp": 1}),
        "/v1/checkpoints/outlink/jobs": (400, {"tp": 1}),
        "/v1/checkpoints/..%2fout/jobs": (404, {"tp": 1}),
        "/v1/checkpoints/llama/jobs": (422, {"tp": 1, "rules": "../../x"}),
        "/v1/checkpoints/llama/jobs?out=/tmp": (422, {"tp": 1, "out": "/tmp", "output_dir": "/tmp"}),
    }
    for target, (status, obj) in refused.items():
        data = json.dumps(obj).encode()
        head = (f"POST {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}")
        got, answer = raw_http(srv, head, data)
        assert got == status, (target, answer[-300:])
    r = httpx.post(srv.ckpt_url("llama") + "/jobs", json={"tp": 2}, headers=GOOD)
    assert r.status_code == 202, r.text
    job_url = f"{srv.url}/v1/jobs/{r.json()['id']}"
    assert wait_for(lambda: httpx.get(job_url, headers=GOOD).json()["state"] == "done")
    job = httpx.get(job_url, headers=GOOD).json()
    real_out = Path(os.path.realpath(out))
    for p in [job["output_dir"], *job["outputs"]]:
        assert Path(os.path.realpath(p)).is_relative_to(real_out), p
    assert tree(guarded["outside"]) == outside_before
    assert not any(re.match(r"(tp-|rank-)", p.name) for p in base.iterdir())

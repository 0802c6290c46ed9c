"""A checkpoint's small files (config, tokenizer) from the service, `reshard pull --meta`, and shards cut
for vLLM (`?engine=vllm`) equal to `reshard write --engine vllm`'s rank files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.cli import main
from tests.support.live import make_ckpt

pytestmark = pytest.mark.servers

SMALL = {"tokenizer.json": b'{"version": "1.0", "model": {"type": "WordLevel"}}',
         "tokenizer_config.json": b'{"unk_token": "w0"}', "generation_config.json": b'{"do_sample": false}'}


@pytest.fixture(scope="module")
def meta_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.live import live_server

    root = tmp_path_factory.mktemp("meta") / "root"
    ckpt = make_ckpt(root / "m", vocab_size=1000, hidden_size=64, num_key_value_heads=2)
    for name, data in SMALL.items():
        (ckpt / name).write_bytes(data)
    (ckpt / "notes.txt").write_text("not served")
    with live_server(root, token="tok") as srv:
        yield srv, ckpt


def test_small_files_listed_and_served(meta_server: Any) -> None:
    srv, ckpt = meta_server
    auth = srv.headers()
    assert httpx.get(f"{srv.ckpt_url('m')}/meta", timeout=10).status_code == 401  # the service's usual token
    listing = httpx.get(f"{srv.ckpt_url('m')}/meta", headers=auth, timeout=10).json()
    want = sorted(["config.json", *SMALL])
    assert sorted(f["name"] for f in listing["files"]) == want
    for f in listing["files"]:
        data = (ckpt / f["name"]).read_bytes()
        assert (f["size"], f["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
        r = httpx.get(f"{srv.ckpt_url('m')}/meta/{f['name']}", headers=auth, timeout=10)
        assert (r.status_code, r.content, r.headers["x-reshard-sha256"]) == (200, data, f["sha256"])
    for name, status, error in (("model.safetensors", 400, "BadRequest"), ("notes.txt", 400, "BadRequest"),
                                ("vocab.json", 404, "NotFoundError")):
        r = httpx.get(f"{srv.ckpt_url('m')}/meta/{name}", headers=auth, timeout=10)
        assert (r.status_code, r.json()["error"]) == (status, error), r.text
    r = httpx.get(f"{srv.ckpt_url('nope')}/meta", headers=auth, timeout=10)
    assert r.status_code == 404 and "no checkpoint named 'nope'" in r.json()["detail"]


def test_pull_meta_copies_them(meta_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    srv, ckpt = meta_server
    out = tmp_path / "model"
    args = ["pull", srv.ckpt_url("m"), "--meta", "-o", str(out), "--token", "tok"]
    assert main(args) == 0
    assert "pulled 4 small files" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", *SMALL])
    assert all((out / n).read_bytes() == (ckpt / n).read_bytes() for n in SMALL)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1000
    assert main(args) == 0  # again: the files are there, verified, kept
    assert main(["pull", srv.ckpt_url("m"), "--meta", "--token", "tok"]) != 0
    assert "give the directory to copy the files into with -o DIR" in capsys.readouterr().err


def test_shards_cut_for_vllm_over_http_equal_rank_files(meta_server: Any, tmp_path: Path) -> None:
    srv, ckpt = meta_server
    assert main(["write", str(ckpt), "--tp", "2", "--engine", "vllm", "-o", str(tmp_path / "w"), "--no-progress"]) == 0
    etags = set()
    for rank in range(2):
        out = tmp_path / f"r{rank}.safetensors"
        assert main(["pull", srv.ckpt_url("m"), "--rank", str(rank), "--tp", "2", "--engine", "vllm",
                     "-o", str(out), "--token", "tok"]) == 0
        assert out.read_bytes() == (tmp_path / "w" / f"rank-{rank:05d}-of-00002.safetensors").read_bytes()
        for engine in ("vllm", None):
            params = {"tp": 2, **({"engine": engine} if engine else {})}
            r = httpx.head(f"{srv.ckpt_url('m')}/shards/{rank}", params=params, headers=srv.headers(), timeout=10)
            etags.add(r.headers["etag"])
    assert len(etags) == 4  # the engine's cut is part of each shard's identity
    r = httpx.get(f"{srv.ckpt_url('m')}/shards/0", params={"tp": 2, "engine": "sglang"}, headers=srv.headers(),
                  timeout=10)
    assert r.status_code == 422


def test_meta_files_stream_and_their_digests_are_hashed_once_per_version(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A 48 MiB tokenizer.json goes out in blocks (this process's traced peak stays far below the file while
    four downloads run), with the sha256 of its bytes; listings and downloads hash each version of a file
    once (a new version is hashed again)."""
    import tracemalloc

    from fastapi.testclient import TestClient

    import reshard.service.api.routers.meta as meta
    from reshard.service import Settings, create_app

    ckpt = make_ckpt(tmp_path / "root" / "m")
    big = bytes(range(256)) * (48 << 12)
    (ckpt / "tokenizer.json").write_bytes(big)
    hashed: list[str] = []
    real = meta.file_sha256
    monkeypatch.setattr(meta, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    with TestClient(create_app(Settings(root=tmp_path / "root", out=tmp_path / "out"))) as client:
        for _ in range(3):
            listing = {f["name"]: f for f in client.get("/v1/checkpoints/m/meta").json()["files"]}
        want = hashlib.sha256(big).hexdigest()
        assert listing["tokenizer.json"] == {"name": "tokenizer.json", "size": len(big), "sha256": want}
        tracemalloc.start()
        for _ in range(4):
            got = hashlib.sha256()
            with client.stream("GET", "/v1/checkpoints/m/meta/tokenizer.json") as r:
                assert r.status_code == 200 and r.headers["x-reshard-sha256"] == want
                for piece in r.iter_bytes():
                    got.update(piece)
            assert got.hexdigest() == want
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 8 << 20, peak  # the file is 48 MiB
        assert hashed.count("tokenizer.json") == 1, hashed
        (ckpt / "tokenizer.json").write_bytes(big[::-1])
        r = client.get("/v1/checkpoints/m/meta/tokenizer.json")
        assert r.headers["x-reshard-sha256"] == hashlib.sha256(big[::-1]).hexdigest() == hashlib.sha256(r.content).hexdigest()
        assert hashed.count("tokenizer.json") == 2

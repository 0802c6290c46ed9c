"""`reshard serve --root s3://BUCKET/PREFIX`: the same shard bytes and strong ETags as from a local root,
JSON 4xx for the client's mistakes and 503 when the store is unreachable, no credential in answers, logs
or metrics, and a TP model built from it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main
from reshard.testing.local_servers import TEST_SECRET
from reshard.testing.local_servers import s3_env as env_for
from tests.support.live import free_port, live_server

pytestmark = pytest.mark.servers


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_serve_root_in_a_store(kind: str, s3_env, web, boto, local_root: Path, tmp_path: Path) -> None:
    from reshard.trainer.build import build_model

    root = "s3://ckpts/models" if kind == "s3" else f"{web.url}/files"
    # the bucket's own listing (other tests of the session add checkpoints beside llama); plain HTTP cannot list
    prefixes = boto.list_objects_v2(Bucket="ckpts", Prefix="models/", Delimiter="/").get("CommonPrefixes", [])
    in_store = sorted(p["Prefix"].split("/")[1] for p in prefixes) if kind == "s3" else []
    assert kind == "http" or "llama" in in_store
    with live_server(root, log_dir=tmp_path, chunk_size=64 << 10) as srv:  # type: ignore[arg-type]
        listed = httpx.get(srv.url + "/v1/checkpoints").json()["checkpoints"]
        assert [c["name"] for c in listed] == in_store
        for tp in (2, 4):
            out = tmp_path / f"local-tp{tp}"
            assert main(["write", str(local_root / "llama"), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 0
            for rank in range(tp):
                r = httpx.get(f"{srv.ckpt_url('llama')}/shards/{rank}", params={"tp": tp}, timeout=60)
                assert r.status_code == 200, r.text
                assert r.content == (out / f"rank-{rank:05d}-of-{tp:05d}.safetensors").read_bytes()
                assert r.headers["etag"].startswith('"') and not r.headers["etag"].startswith("W/")
                again = httpx.get(f"{srv.ckpt_url('llama')}/shards/{rank}", params={"tp": tp},
                                  headers={"If-None-Match": r.headers["etag"]})
                assert again.status_code == 304
        missing = httpx.get(srv.ckpt_url("nope"))
        assert missing.status_code == 404 and missing.json()["error"] == "NotFoundError"
        bad = httpx.get(srv.ckpt_url("a..b"))
        assert bad.status_code == 400 and "error" in bad.json()
        upload = httpx.put(srv.ckpt_url("llama") + "/files/config.json", content=b"{}")
        assert upload.status_code == 400 and "local --root" in upload.json()["detail"]
        if kind == "http":
            return
        model = build_model(srv.ckpt_url("llama"))  # tp=1: no process group
        ref = load_file(local_root / "llama" / "model-00001-of-00002.safetensors")
        ref |= load_file(local_root / "llama" / "model-00002-of-00002.safetensors")
        params = dict(model.named_parameters())
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            torch.testing.assert_close(params[name].detach(), ref[name], rtol=0, atol=0)
        metrics = httpx.get(srv.url + "/metrics").text
        assert TEST_SECRET not in metrics and TEST_SECRET not in srv.log()


def test_serve_answers_503_when_the_store_is_unreachable(tmp_path: Path, monkeypatch) -> None:
    for k, v in env_for(f"http://127.0.0.1:{free_port()}").items():  # the store goes away
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RESHARD_STORE_RETRIES", "1")
    with live_server("s3://ckpts/models", log_dir=tmp_path) as srv:  # type: ignore[arg-type]
        r = httpx.get(srv.ckpt_url("llama"), timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "StoreUnavailableError" and "cannot reach" in r.json()["detail"]
        assert TEST_SECRET not in r.text and TEST_SECRET not in srv.log()

"""`reshard.io.client.shard_client` against the live server: pull, read, resume, broken connections, integrity, CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from reshard.errors import IntegrityError, NotFoundError, PlanError, ReshardError
from reshard.format.rank_file import rank_file_name
from reshard.io.client.shard_client import ShardClient
from tests.support.live import BIG, LiveServer

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


def test_info_plan_read_iter(server: LiveServer, written: Any) -> None:
    want = (written("qwen2", 2) / rank_file_name(1, 2)).read_bytes()
    with ShardClient(server.ckpt_url("qwen2")) as c:
        info = c.info()
        assert info["config"]["model_type"] == "qwen2" and len(info["files"]) == 3
        assert c.plan(2, tensors=False)["ranks"][1]["bytes"] == len(want)
        assert c.read_shard(1, 2) == want
        assert b"".join(c.iter_shard(1, 2)) == want
        assert b"".join(c.iter_shard(1, 2, start=1000)) == want[1000:]
        head = c.head(1, 2)
        assert head.size == len(want) and head.etag.startswith('"')


def test_pull_atomic(server: LiveServer, written: Any, tmp_path: Path) -> None:
    want = written("phi3", 4) / rank_file_name(2, 4)
    dest = tmp_path / "r2.safetensors"
    result = ShardClient(server.ckpt_url("phi3")).pull(2, 4, dest, progress=False)
    assert dest.read_bytes() == want.read_bytes()
    record = json.loads((want.parent / "reshard.json").read_text())
    assert result["sha256"] == record["files"][want.name]["sha256"] and result["resumed_from"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r2.safetensors"]  # no temp files left


def _partial(client: ShardClient, dest: Path, data: bytes, etag: str, rank: int, tp: int) -> None:
    dest.with_name(f".{dest.name}.part").write_bytes(data)
    dest.with_name(f".{dest.name}.part.json").write_text(
        json.dumps({"url": client.shard_url(rank), "tp": tp, "etag": etag}))


def test_pull_resumes_partial_file(server: LiveServer, written: Any, tmp_path: Path) -> None:
    want = (written(BIG, 8) / rank_file_name(5, 8)).read_bytes()
    client = ShardClient(server.ckpt_url(BIG))
    dest = tmp_path / "r5.safetensors"
    _partial(client, dest, want[:3_000_001], client.head(5, 8).etag, 5, 8)
    result = client.pull(5, 8, dest, progress=False)
    assert result["resumed_from"] == 3_000_001 and dest.read_bytes() == want
    # a partial left for another version of the shard is discarded, not mixed in
    dest.unlink()
    _partial(client, dest, b"x" * 1000, '"stale"', 5, 8)
    assert client.pull(5, 8, dest, progress=False)["resumed_from"] == 0 and dest.read_bytes() == want
    # a complete partial file just needs verifying
    dest.unlink()
    _partial(client, dest, want, client.head(5, 8).etag, 5, 8)
    assert client.pull(5, 8, dest, progress=False)["resumed_from"] == len(want) and dest.read_bytes() == want


def test_pull_detects_corrupt_partial(server: LiveServer, written: Any, tmp_path: Path) -> None:
    want = (written("llama", 2) / rank_file_name(0, 2)).read_bytes()
    client = ShardClient(server.ckpt_url("llama"))
    dest = tmp_path / "r0.safetensors"
    bad = bytearray(want[:5000])
    bad[4000] ^= 0xFF
    _partial(client, dest, bytes(bad), client.head(0, 2).etag, 0, 2)
    with pytest.raises(IntegrityError, match="sha256"):
        client.pull(0, 2, dest, progress=False)
    assert list(tmp_path.iterdir()) == []  # the bad partial is gone, nothing published
    assert client.pull(0, 2, dest, progress=False)["resumed_from"] == 0 and dest.read_bytes() == want


def test_resume_after_broken_connections(server: LiveServer, written: Any, cutting_proxy: Any,
                                         tmp_path: Path) -> None:
    want = (written(BIG, 2) / rank_file_name(1, 2)).read_bytes()
    port = int(server.url.rsplit(":", 1)[1])
    with cutting_proxy(("127.0.0.1", port), cut_after=5_000_000, cuts=3) as proxy:
        client = ShardClient(f"{proxy.url}/v1/checkpoints/{BIG}", backoff=0.01)
        assert client.read_shard(1, 2) == want
        ranges = [m.group(1) for r in proxy.requests if (m := re.search(rb"range: bytes=(\d+)-", r, re.I))]
        if_range = [r for r in proxy.requests if b"if-range" in r.lower()]
    assert len(ranges) == 3 and all(int(x) > 0 for x in ranges), proxy.requests
    assert len(if_range) == 3
    with cutting_proxy(("127.0.0.1", port), cut_after=4_000_000, cuts=2) as proxy:
        dest = tmp_path / "r1.safetensors"
        ShardClient(f"{proxy.url}/v1/checkpoints/{BIG}", backoff=0.01).pull(1, 2, dest, progress=False)
        assert dest.read_bytes() == want


def test_gives_up_after_retries(server: LiveServer, cutting_proxy: Any) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with cutting_proxy(("127.0.0.1", port), cut_after=100, cuts=100) as proxy:
        client = ShardClient(f"{proxy.url}/v1/checkpoints/llama", retries=2, backoff=0.01)
        with pytest.raises(ReshardError, match="giving up after 2 retries"):
            client.read_shard(0, 2)


def test_shard_changing_mid_download_is_detected(server: LiveServer, ckpt_root: Path, cutting_proxy: Any) -> None:
    shutil.copytree(ckpt_root / BIG, ckpt_root / "mutable")
    port = int(server.url.rsplit(":", 1)[1])
    weights = ckpt_root / "mutable" / "model.safetensors"

    def touch() -> None:  # a new mtime: a new source identity, so a new ETag
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    with cutting_proxy(("127.0.0.1", port), cut_after=2_000_000, cuts=1) as proxy:
        proxy.on_cut = touch
        client = ShardClient(f"{proxy.url}/v1/checkpoints/mutable", backoff=0.01)
        with pytest.raises(IntegrityError, match="changed on the server"):
            client.read_shard(0, 2)
    assert ShardClient(server.ckpt_url("mutable")).read_shard(0, 2)[:8] == client.read_shard(0, 2)[:8]
    shutil.rmtree(ckpt_root / "mutable")


def test_client_errors(server: LiveServer) -> None:
    with pytest.raises(ReshardError, match="not a checkpoint URL"):
        ShardClient(server.url)
    with pytest.raises(NotFoundError):
        ShardClient(server.ckpt_url("missing")).info()
    with pytest.raises(PlanError, match="not divisible"):
        ShardClient(server.ckpt_url("llama")).read_shard(0, 3)
    with pytest.raises(NotFoundError, match="stored manifest"):
        ShardClient(server.ckpt_url("llama"), rules="nope").plan(2)
    with pytest.raises(ReshardError, match="giving up"):
        ShardClient("http://127.0.0.1:9/v1/checkpoints/x", retries=1, backoff=0.01, timeout=2).info()


def test_cli_pull(server: LiveServer, written: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.cli import main

    dest = tmp_path / "out.safetensors"
    assert main(["pull", server.ckpt_url("llama"), "--rank", "3", "--tp", "4", "-o", str(dest), "--no-progress"]) == 0
    assert dest.read_bytes() == (written("llama", 4) / rank_file_name(3, 4)).read_bytes()
    assert "pulled rank 3 of tp=4" in capsys.readouterr().out
    assert main(["pull", server.ckpt_url("llama"), "--rank", "9", "--tp", "4", "-o", str(dest)]) == 1
    assert "rank=9 is out of range" in capsys.readouterr().err

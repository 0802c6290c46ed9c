"""One node, one rank, straight from the store (`reshard write URL --tp 8 --ranks R`): a row-split
tensor's slices come exactly from a static HTTP server that answers several ranges per request, as
row blocks from S3 (one range per request) unless asked otherwise; the bytes are the local shard's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reshard.cli import main
from reshard.io.sources import open_source
from reshard.plan.planner import make_plan
from tests.support.live import make_ckpt

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

TP, RANK = 8, 3
SHAPE = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 1, "vocab_size": 2048,
         "num_attention_heads": 8, "num_key_value_heads": 8}  # float32: a row is 4-8 KiB, a rank's slice 1/8


@pytest.fixture(scope="module")
def wide(local_root: Path, s3: Any) -> Path:
    """ROOT/wide: row-split tensors whose rows a tp=8 rank takes an eighth of (also in the bucket)."""
    import boto3

    path = make_ckpt(local_root / "wide", num_files=2, **SHAPE)
    env = s3.env
    client = boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])
    for p in sorted(path.iterdir()):
        client.upload_file(str(p), "ckpts", f"models/wide/{p.name}")
    return path


def _write(url: str, out: Path) -> Path:
    assert main(["write", url, "--tp", str(TP), "--ranks", str(RANK), "-o", str(out), "--no-progress"]) == 0
    return out / f"rank-{RANK:05d}-of-{TP:05d}.safetensors"


def _rows(local: Path) -> int:
    src, manifest = open_source(local)
    rp = make_plan(src, manifest, TP, ranks=[RANK]).ranks[0]
    return sum(s.count for t in rp.tensors for s in t.segments if s.file and not s.contiguous)


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_one_rank_fetches_close_to_its_shard(kind: str, wide: Path, web: Any, s3: Any, s3_env: Any,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv, url = (web, f"{web.url}/files/wide/") if kind == "http" else (s3, "s3://ckpts/models/wide")
    local = _write(str(wide), tmp_path / "local")
    shard = local.stat().st_size
    srv.reset()
    got = _write(url, tmp_path / "remote")
    counts = srv.reset()
    assert got.read_bytes() == local.read_bytes()
    headers = 3 * 128 << 10  # the speculative header reads and the JSON files
    if kind == "http":  # several ranges per request: the rows' slices exactly, requests bounded
        assert counts["bytes"] <= 1.3 * shard + headers, (counts, shard)
        assert counts["requests"] <= _rows(wide) // 64 + 40, counts
    else:  # one range per request: the row blocks (tp times a row-split tensor's share), few requests
        assert 1.3 * shard < counts["bytes"] <= 4 * shard + headers, (counts, shard)
        assert counts["requests"] * 20 <= _rows(wide), counts
        monkeypatch.setenv("RESHARD_STORE_ROW_BLOCKS", "false")  # each row's slice on its own: exact, many GETs
        got = _write(url, tmp_path / "slices")
        counts = srv.reset()
        assert got.read_bytes() == local.read_bytes()
        assert counts["bytes"] <= 1.3 * shard + headers and counts["requests"] >= _rows(wide) // 2, counts


def test_a_server_answering_one_range_is_asked_one_range(tmp_path: Path) -> None:
    """A server that answers a request for several ranges with the whole file (200) is asked once (the
    probe, whose answer is not read) and then one range per request: the rank's bytes all the same."""
    from bench.stores import http_server

    path = make_ckpt(tmp_path / "root" / "wide", num_files=1, **SHAPE)
    local = _write(str(path), tmp_path / "local")
    with http_server(tmp_path / "root", one_range=True) as web:
        got = _write(f"{web.url}/files/wide/", tmp_path / "remote")
        counts = web.reset()
    assert got.read_bytes() == local.read_bytes()
    assert counts["bytes"] < 5 * local.stat().st_size and counts["requests"] * 20 <= _rows(path), counts

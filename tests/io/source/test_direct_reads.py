"""One node, one rank, straight from the store (`reshard write URL --tp 8 --ranks R`): a row-split
tensor's rows come as their slices or as the row block that covers them, whichever the store's costs
price lower (`reshard.io.source.readcost`): over a slow link, the slices exactly from a static HTTP server that
answers several ranges per request, the row blocks from S3 (a request per row costs more than the gaps'
bytes); either way, or as `RESHARD_STORE_ROWS` says, the bytes are the local shard's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reshard.cli import main
from reshard.io.source.opener import open_source
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


SLOW = {"RESHARD_STORE_BANDWIDTH": "1000000"}  # 1 MB/s: a row block's gaps cost more than a multi-range request
HEADERS = 3 * 128 << 10  # the speculative header reads and the JSON files


def _fetched(srv: Any, url: str, out: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, dict[str, int]]:
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        srv.reset()
        got = _write(url, out).read_bytes()
        return got, srv.reset()


def test_over_a_slow_link_http_slices_come_exactly(wide: Path, web: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Several ranges per request (Starlette: 64 of them after the probe), the slices exactly; the
    default on loopback and RESHARD_STORE_ROWS=blocks fetch the row blocks."""
    local = _write(str(wide), tmp_path / "local").read_bytes()
    url, rows = f"{web.url}/files/wide/", _rows(wide)
    got, counts = _fetched(web, url, tmp_path / "slow", SLOW, monkeypatch)
    assert got == local
    assert counts["bytes"] <= 1.15 * len(local) + HEADERS, (counts, len(local))
    assert counts["requests"] <= rows // 64 + 40, counts
    got, blocks = _fetched(web, url, tmp_path / "blocks", {"RESHARD_STORE_ROWS": "blocks"}, monkeypatch)
    assert got == local
    assert 1.3 * len(local) < blocks["bytes"] <= 4 * len(local) + HEADERS and blocks["requests"] * 20 <= rows, blocks
    got, auto = _fetched(web, url, tmp_path / "auto", {}, monkeypatch)  # loopback: what the costs measured say
    assert got == local
    assert counts["bytes"] <= auto["bytes"] <= blocks["bytes"] * 1.05 and auto["requests"] <= rows // 20, auto


def test_from_s3_the_row_blocks_unless_slices_are_asked_for(wide: Path, s3: Any, s3_env: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One range per request: at 20 ms a request, a request per row costs more than the gaps' bytes even
    at 1 MB/s, so the row blocks; RESHARD_STORE_ROWS=slices: each row's slice, a GET each."""
    local = _write(str(wide), tmp_path / "local").read_bytes()
    url, rows = "s3://ckpts/models/wide", _rows(wide)
    got, counts = _fetched(s3, url, tmp_path / "slow", {**SLOW, "RESHARD_STORE_REQUEST_COST": "0.02"}, monkeypatch)
    assert got == local
    assert 1.3 * len(local) < counts["bytes"] <= 4 * len(local) + HEADERS and counts["requests"] * 20 <= rows, counts
    got, slices = _fetched(s3, url, tmp_path / "slices", {"RESHARD_STORE_ROWS": "slices"}, monkeypatch)
    assert got == local
    assert slices["bytes"] <= 1.3 * len(local) + HEADERS and slices["requests"] >= rows // 2, slices


def test_a_server_answering_one_range_is_asked_one_range(tmp_path: Path) -> None:
    """A server that answers a request for several ranges with the whole file (200) is asked once (the
    probe, whose answer is not read) and then one range per request: the rank's bytes all the same."""
    from reshard.testing.local_servers import http_server

    path = make_ckpt(tmp_path / "root" / "wide", num_files=1, **SHAPE)
    local = _write(str(path), tmp_path / "local")
    with http_server(tmp_path / "root", one_range=True) as web:
        got = _write(f"{web.url}/files/wide/", tmp_path / "remote")
        counts = web.reset()
    assert got.read_bytes() == local.read_bytes()
    assert counts["bytes"] < 5 * local.stat().st_size and counts["requests"] * 20 <= _rows(path), counts

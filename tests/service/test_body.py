"""`reshard.io.client.body.ShardBody` against the live server: the shard's bytes straight into the caller's
buffers, resumed after broken connections, a changed shard refused, the server's errors raised as the
client raises them, and the digest the bytes must have."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from reshard.errors import IntegrityError, NotFoundError, PlanError, ReshardError
from reshard.format.rank_file import rank_file_name
from reshard.io.client.body import ShardBody, file_body
from tests.support.live import BIG, LiveServer

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


def _read_all(body: Any, sizes: tuple[int, ...] = (8, 1000, 3_000_001)) -> bytes:
    """The whole body, read into buffers of uneven sizes (the last one takes the rest)."""
    out = bytearray(body.size)
    view, pos, i = memoryview(out), 0, 0
    while pos < body.size:
        n = min(sizes[i % len(sizes)], body.size - pos)
        body.readinto(view[pos : pos + n])
        pos, i = pos + n, i + 1
    return bytes(out)


def test_body_reads_the_shard_into_given_buffers(server: LiveServer, written: Any) -> None:
    path = written("qwen2", 2) / rank_file_name(1, 2)
    want = path.read_bytes()
    recorded = json.loads((path.parent / "reshard.json").read_text())["files"][path.name]["sha256"]
    body = ShardBody(server.ckpt_url("qwen2"), 1, 2)
    try:
        assert body.size == len(want) and _read_all(body) == want
        assert body.expected_sha256() == recorded == hashlib.sha256(want).hexdigest()
        with pytest.raises(IntegrityError, match="asked for bytes up to"):
            body.readinto(memoryview(bytearray(1)))  # nothing after the last byte
    finally:
        body.close()
    local = file_body(path, sha256=recorded)
    try:
        assert b"".join(local) == want and local.expected_sha256() == recorded and local.verify
    finally:
        local.close()


def test_body_resumes_after_broken_connections(server: LiveServer, written: Any, cutting_proxy: Any) -> None:
    want = (written(BIG, 2) / rank_file_name(0, 2)).read_bytes()
    port = int(server.url.rsplit(":", 1)[1])
    with cutting_proxy(("127.0.0.1", port), cut_after=5_000_000, cuts=3) as proxy:
        body = ShardBody(f"{proxy.url}/v1/checkpoints/{BIG}", 0, 2, backoff=0.01)
        try:
            assert _read_all(body) == want
        finally:
            body.close()
        ranges = [int(m.group(1)) for r in proxy.requests if (m := re.search(rb"range: bytes=(\d+)-", r, re.I))]
        if_range = [r for r in proxy.requests if b"if-range" in r.lower()]
    assert len(ranges) == 3 and all(0 < x < len(want) for x in ranges) and len(if_range) == 3, proxy.requests
    with cutting_proxy(("127.0.0.1", port), cut_after=100, cuts=100) as proxy:
        with pytest.raises(ReshardError, match="giving up after 2 retries"):
            _read_all(ShardBody(f"{proxy.url}/v1/checkpoints/{BIG}", 0, 2, retries=2, backoff=0.01))


def test_body_refuses_a_shard_that_changed(server: LiveServer, ckpt_root: Path, cutting_proxy: Any) -> None:
    shutil.copytree(ckpt_root / BIG, ckpt_root / "mutable-body")
    weights = ckpt_root / "mutable-body" / "model.safetensors"

    def touch() -> None:  # a new mtime: a new source identity, so a new ETag
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    port = int(server.url.rsplit(":", 1)[1])
    try:
        with cutting_proxy(("127.0.0.1", port), cut_after=2_000_000, cuts=1) as proxy:
            proxy.on_cut = touch
            body = ShardBody(f"{proxy.url}/v1/checkpoints/mutable-body", 0, 2, backoff=0.01)
            with pytest.raises(IntegrityError, match="changed on the server"):
                _read_all(body)
            body.close()
    finally:
        shutil.rmtree(ckpt_root / "mutable-body")


def test_body_raises_the_servers_errors(server: LiveServer) -> None:
    with pytest.raises(NotFoundError, match="no checkpoint named 'missing'"):
        ShardBody(server.ckpt_url("missing"), 0, 2)
    with pytest.raises(PlanError, match="not divisible"):
        ShardBody(server.ckpt_url("llama"), 0, 3)

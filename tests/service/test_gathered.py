"""Copies of gathered (row-split) pieces, `reshard.service.transport.gathered`, against a real two-worker `reshard serve`:
the bytes every pull gets (whole and ranges) are `reshard write`'s, the copy holds exactly the plan's
gathered pieces, later pulls send them with sendfile, and changes, eviction, disconnects and an
unusable directory behave."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.format.rank_file import rank_file_name
from reshard.io.sealed import TRAILER
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.plan.reads import Interleave, Segment
from reshard.service.transport.gathered import LEAD
from reshard.service.transport.pump import DIRECT_MIN
from tests.support.live import (
    BIG,
    LiveServer,
    live_server,
    make_ckpt,
    metric,
    raw_request,
    sendfile_bytes,
    streams_settled,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]
TP = 2


def gathered_pieces(ckpt: Path, rank: int) -> list[tuple[int, int]]:
    """(offset, length) in the rank file of every piece the plan gathers (not one contiguous range of
    a source file) of at least DIRECT_MIN bytes: what a copy must hold, in order."""
    src, manifest = open_source(ckpt)
    rp = make_plan(src, manifest, TP).ranks[rank]
    pos, out = len(rp.header), []
    for t in rp.tensors:
        for seg in t.segments:
            contiguous = isinstance(seg, Segment) and seg.contiguous
            if (isinstance(seg, Interleave) or (not contiguous and seg.file is not None)) and seg.nbytes >= DIRECT_MIN:
                out.append((pos, seg.nbytes))
            pos += seg.nbytes
    return out


def copies(root: Path) -> dict[str, int]:
    d = root / ".reshard" / "gathered"
    return {p.name: p.stat().st_size for p in d.iterdir()} if d.is_dir() else {}


@pytest.fixture
def root(ckpt_root: Path, tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    shutil.copytree(ckpt_root / BIG, r / "m", copy_function=shutil.copyfile)
    return r


def _url(srv: LiveServer, rank: int) -> str:
    return f"{srv.ckpt_url('m')}/shards/{rank}"


def test_second_whole_pull_keeps_a_copy_later_pulls_send_it(root: Path, written: Any) -> None:
    want = (written(BIG, TP) / rank_file_name(1, TP)).read_bytes()
    pieces = gathered_pieces(root / "m", 1)
    total = sum(n for _, n in pieces)
    assert total > len(want) // 5  # o_proj and down_proj are row-split
    with live_server(root, workers=2) as srv, httpx.Client(timeout=60) as http:
        url, params = _url(srv, 1), {"tp": TP}
        assert http.get(url, params=params).content == want
        assert not [n for n in copies(root) if n.endswith(".bin")]  # pulled once: a marker only
        assert http.get(url, params=params).content == want
        made = {n: s for n, s in copies(root).items() if n.endswith(".bin")}
        assert list(made.values()) == [LEAD + total + 16 * len(pieces) + 8 + TRAILER]  # pieces, their index, the seal
        assert metric(srv, 'reshard_gathered_copies_total{event="written"}') == 1
        copy = (root / ".reshard" / "gathered" / next(iter(made))).read_bytes()
        assert copy[LEAD : LEAD + total] == b"".join(want[o : o + n] for o, n in pieces)  # the pieces, in order
        for _ in range(4):  # both workers: the copy is in the directory they share
            before = metric(srv, "reshard_shard_bytes_sendfile_total")
            assert http.get(url, params=params).content == want
            sent = metric(srv, "reshard_shard_bytes_sendfile_total") - before
            assert sent == sendfile_bytes(root / "m", TP, 1, 0, len(want)) + total
        assert metric(srv, 'reshard_gathered_copies_total{event="used"}') == 4
        o, n = pieces[-1]
        for a, b in [(o + 1000, o + n - 7), (o - 5, o + 3), (17, len(want) - 1)]:  # ranges in and across pieces
            r = http.get(url, params=params, headers={"Range": f"bytes={a}-{b}"})
            assert r.status_code == 206 and r.content == want[a : b + 1]
        assert http.get(url, params=params).content == want


def test_changed_source_never_meets_an_old_copy(root: Path, tmp_path: Path) -> None:
    from reshard.cli import main

    other = make_ckpt(tmp_path / "other", hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                      vocab_size=2048, num_attention_heads=8, num_key_value_heads=8, seed=7)
    assert main(["write", str(other), "--tp", str(TP), "-o", str(tmp_path / "want"), "--no-progress"]) == 0
    want = (tmp_path / "want" / rank_file_name(0, TP)).read_bytes()
    with live_server(root, gather_cache=1 << 30) as srv, httpx.Client(timeout=60) as http:
        url, params = _url(srv, 0), {"tp": TP}
        old = [http.get(url, params=params).content for _ in range(3)]
        assert old[0] == old[1] == old[2] != want and metric(srv, 'reshard_gathered_copies_total{event="used"}') == 1
        tmp = root / "m" / "model.safetensors.new"
        shutil.copyfile(other / "model.safetensors", tmp)
        os.replace(tmp, root / "m" / "model.safetensors")  # published by rename: a new ETag
        got = [http.get(url, params=params).content for _ in range(3)]
        assert got == [want] * 3
        assert metric(srv, 'reshard_gathered_copies_total{event="used"}') == 2  # the new version's copy


def test_copies_past_the_cap_are_evicted_oldest_first(root: Path) -> None:
    sizes = [LEAD + sum(n for _, n in p) + 16 * len(p) + 8 + TRAILER for p in (gathered_pieces(root / "m", r) for r in range(TP))]
    with live_server(root, gather_cache=max(sizes) + 1) as srv, httpx.Client(timeout=60) as http:
        for rank in range(TP):
            for _ in range(2):
                http.get(_url(srv, rank), params={"tp": TP})
            time.sleep(0.02)  # distinct mtimes
        made = [n for n in copies(root) if n.endswith(".bin")]
        assert len(made) == 1 and made[0].endswith(f"-r{TP - 1}.bin")  # rank 0's copy made room
        assert metric(srv, 'reshard_gathered_copies_total{event="written"}') == TP


def test_a_pull_cut_short_publishes_nothing(root: Path) -> None:
    with live_server(root, chunk_size=256 << 10) as srv:  # the reader runs at most a few chunks ahead
        target = "/v1/checkpoints/m/shards/1?tp=2"
        httpx.get(srv.url + target, timeout=60)  # the marker
        got = raw_request(srv, target, read=1 << 20)  # hangs up while the copy is being written
        assert got.startswith(b"HTTP/1.1 200")
        streams_settled(srv)
        assert not [n for n in copies(root) if n.endswith((".bin", ".tmp"))], copies(root)


def test_an_unusable_directory_only_turns_copies_off(root: Path, written: Any) -> None:
    want = (written(BIG, TP) / rank_file_name(1, TP)).read_bytes()
    (root / ".reshard").mkdir()
    (root / ".reshard" / "gathered").write_text("not a directory")
    with live_server(root) as srv:
        for _ in range(3):
            assert httpx.get(_url(srv, 1), params={"tp": TP}, timeout=60).content == want
        assert "gathered pieces are not kept" in srv.log()
        assert metric(srv, 'reshard_gathered_copies_total{event="written"}') == 0


def test_nothing_to_copy_and_a_damaged_copy(root: Path, written: Any) -> None:
    """A shard without gathered pieces is looked at once (then a `.none` marker); a copy whose index
    does not match the file (cut short, say) is not used, and the next whole pull replaces it."""
    want = (written(BIG, TP) / rank_file_name(1, TP)).read_bytes()
    d = root / ".reshard" / "gathered"
    with live_server(root) as srv, httpx.Client(timeout=60) as http:
        for _ in range(3):  # tp=1: every tensor whole, contiguous in its file
            http.get(f"{srv.ckpt_url('m')}/shards/0", params={"tp": 1})
        assert [n for n in copies(root) if n.endswith((".none", ".bin", ".tmp"))] == [
            next(n for n in copies(root) if n.endswith(".none"))]
        for _ in range(2):
            assert http.get(_url(srv, 1), params={"tp": TP}).content == want
        (copy,) = d.glob("*.bin")
        size = copy.stat().st_size
        with open(copy, "r+b") as f:
            f.truncate(size - 24)  # the index no longer adds up
        used = metric(srv, 'reshard_gathered_copies_total{event="used"}')
        assert http.get(_url(srv, 1), params={"tp": TP}).content == want  # gathered; rewrites the copy
        assert metric(srv, 'reshard_gathered_copies_total{event="used"}') == used
        assert copy.stat().st_size == size
        assert http.get(_url(srv, 1), params={"tp": TP}).content == want
        assert metric(srv, 'reshard_gathered_copies_total{event="used"}') == used + 1
        copy.write_bytes(b"tiny")  # shorter than any index
        assert http.get(_url(srv, 1), params={"tp": TP}).content == want
        assert copy.stat().st_size == size  # rewritten
        assert "Traceback" not in srv.log()


def test_concurrent_whole_pulls_write_one_copy(root: Path, written: Any) -> None:
    """A storm of whole pulls of one shard after its marker: every body is right, and one copy (of the
    right size) is written, not one per pull."""
    from concurrent.futures import ThreadPoolExecutor

    want = (written(BIG, TP) / rank_file_name(1, TP)).read_bytes()
    with live_server(root, workers=2, chunk_size=256 << 10) as srv:
        url = _url(srv, 1)
        assert httpx.get(url, params={"tp": TP}, timeout=60).content == want  # the marker
        with ThreadPoolExecutor(8) as pool:
            bodies = list(pool.map(lambda _: httpx.get(url, params={"tp": TP}, timeout=60).content, range(8)))
        assert all(b == want for b in bodies)
        assert metric(srv, 'reshard_gathered_copies_total{event="written"}') == 1
        assert [n for n in copies(root) if n.endswith((".bin", ".tmp"))] == [next(n for n in copies(root) if n.endswith(".bin"))]

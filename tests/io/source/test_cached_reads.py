"""A root in a store served from the node's block cache as local files are (`reshard.io.source.cached_object`):
contiguous ranges by `sendfile` from the block files, row-split runs gathered from their mappings, the
bytes the local shards'; block files held open within bounds, released as the body goes out; a block
that cannot be kept on disk served from memory."""

from __future__ import annotations

import errno
import os
import resource
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.cli import main
from reshard.io.rank_stream import RankStream
from reshard.io.source import store_cache, stores
from reshard.io.source.cached_object import OPEN
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from tests.support.hard import metric
from tests.support.live import live_server, make_ckpt

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

BLOCK = 256 << 10  # blocks the contiguous slices (1-2 MiB) span several of
SHAPE = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 1, "vocab_size": 2048,
         "num_attention_heads": 8, "num_key_value_heads": 8}  # float32: q_proj's half at tp=2 is 2 MiB


@pytest.fixture(scope="module")
def big(local_root: Path) -> Path:
    """ROOT/big, served by the static HTTP server of the session (`web`)."""
    return make_ckpt(local_root / "big", num_files=2, **SHAPE)


def _local(src: Path, tp: int, out: Path) -> dict[int, bytes]:
    if not out.exists():
        assert main(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 0
    return {r: (out / f"rank-{r:05d}-of-{tp:05d}.safetensors").read_bytes() for r in range(tp)}


def _pull(srv: Any, tp: int, rank: int, headers: dict[str, str] | None = None) -> httpx.Response:
    r = httpx.get(f"{srv.ckpt_url('big')}/shards/{rank}", params={"tp": tp}, headers=headers, timeout=120)
    assert r.status_code in (200, 206), r.text
    return r


def test_cached_blocks_go_out_by_sendfile(big: Path, web: Any, tmp_path: Path) -> None:
    """Every rank of tp=2 and tp=4 pulled at once, twice (the first pull of a shard is hashed, so read
    through Python): the second time the contiguous slices leave the block files by sendfile, and
    every block was fetched once."""
    files = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    want = {(tp, r): b for tp in (2, 4) for r, b in _local(big, tp, tmp_path / f"tp{tp}").items()}
    with live_server(f"{web.url}/files", log_dir=tmp_path, workers=2, store_cache=1 << 30,  # type: ignore[arg-type]
                     store_cache_block=BLOCK, store_cache_dir=tmp_path / "cache", gather_cache=0) as serve:
        web.reset()
        for _round in range(2):
            assert _pull_all(serve, list(want)) == want, serve.log()[-3000:]
        sent = metric(serve, "reshard_shard_bytes_sendfile_total")
        column = sum(s.nbytes for tp in (2, 4) for rp in _plans(big, tp) for t in rp.tensors for s in t.segments
                     if s.file and s.contiguous and s.nbytes >= 4 * BLOCK)
        assert sent >= 0.9 * column, (sent, column)  # the long slices, once (their second pull), but for edges
        assert files <= web.reset()["bytes"] <= files + (256 << 10)  # each block once, headers and JSON aside
        part = _pull(serve, 2, 1, {"Range": "bytes=1000000-3999999"})  # a range straddling blocks
        assert part.status_code == 206 and part.content == want[(2, 1)][1000000:4000000]
        assert serve.alive() and "Traceback" not in serve.log(), serve.log()


def _pull_all(srv: Any, pulls: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """Every (tp, rank) at once, one thread each: its bytes, or what failed it."""
    got: dict[tuple[int, int], Any] = {}

    def pull(k: tuple[int, int]) -> None:
        try:
            got[k] = _pull(srv, *k).content
        except BaseException as e:  # reported by the comparison
            got[k] = repr(e)

    threads = [threading.Thread(target=pull, args=(k,)) for k in pulls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def _plans(src: Path, tp: int) -> list[Any]:
    ckpt, manifest = open_source(src)
    return make_plan(ckpt, manifest, tp).ranks


def test_block_files_held_open_within_bounds(big: Path, web: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, tiny blocks: a stream's kernel-copy sources are its block files, each pinned until
    `done` passes it; at most OPEN unpinned blocks stay open per object; closing the stream closes them all."""
    monkeypatch.setattr(store_cache, "_CACHE", None)
    cache = store_cache.enable(tmp_path / "cache", 1 << 30, block=64 << 10)
    assert cache is not None
    try:
        remote, manifest = open_source(f"{web.url}/files/big/")
        for rp, want in zip(make_plan(remote, manifest, 2).ranks, _local(big, 2, tmp_path / "tp2").values()):
            out = bytearray(rp.size)
            with RankStream(rp) as stream:
                for pos, n, src in stream.runs(chunk_size=1 << 20, direct_min=16 << 10):
                    if callable(src):
                        src = src()
                    if src is None:
                        stream.read_into(pos, memoryview(out)[pos : pos + n])
                    else:
                        out[pos : pos + n] = os.pread(src[0], n, src[1])
                        stream.done(pos + n)
                    held = [r.blocks for r in stream._readers.values() if r.blocks is not None]  # type: ignore[union-attr]
                    opened = []
                    for o in held:  # as the object sees them: the fetch pool lands blocks meanwhile
                        with o._lock:
                            opened.append(list(o._open.values()))
                    assert all(sum(b.pins == 0 for b in blocks) <= OPEN for blocks in opened)
                    # each open block a descriptor, a mapped one two (mmap keeps its own), and those landing
                    assert _open_blocks(tmp_path / "cache") <= 2 * len(held) * (OPEN + 1) + 16
                    assert sum(b.pins for blocks in opened for b in blocks) <= 1  # done() unpinned each (one: the next)
                assert bytes(out) == want
            assert _open_blocks(tmp_path / "cache") == 0
        assert cache.hits > 0 and cache.fetched >= sum(p.stat().st_size for p in big.glob("*.safetensors"))
    finally:
        store_cache.disable()


def _open_blocks(cache: Path) -> int:
    """Descriptors of this process open on block files of `cache` (not their lock files)."""
    where = str(cache.resolve())
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum(link.startswith(where) and os.path.basename(link).isdigit() for link in links)


@pytest.mark.parametrize("fails", ["rename", "write"])
def test_a_block_that_cannot_be_kept_is_served_from_memory(big: Path, web: Any, tmp_path: Path, fails: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk: no block file is written, each pull reads the bytes it fetched, all the same. `rename`:
    the finished block cannot be put in place; `write`: the file stops growing part-way through a
    block (a file size limit: the kernel answers EFBIG), while its bytes still arrive."""
    want = _local(big, 2, tmp_path / "tp2")[0]
    monkeypatch.setattr(store_cache, "_CACHE", None)
    cache = store_cache.enable(tmp_path / "cache", 1 << 30, block=256 << 10)
    assert cache is not None

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if fails == "rename":
        monkeypatch.setattr(store_cache.os, "rename", full)
    else:
        monkeypatch.setattr(stores, "CHUNK", 32 << 10)  # blocks arrive in pieces: the file fails after the third
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100 << 10, limit[1]))
    try:
        remote, manifest = open_source(f"{web.url}/files/big/")
        rp = make_plan(remote, manifest, 2).ranks[0]
        out = bytearray(rp.size)
        with RankStream(rp) as stream:
            for pos, n, src in stream.runs(chunk_size=1 << 20, direct_min=16 << 10):
                got = src() if callable(src) else src
                assert got is None  # nothing on disk to send from
                stream.read_into(pos, memoryview(out)[pos : pos + n])
    finally:
        if fails == "write":
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, old)
        store_cache.disable()
    assert bytes(out) == want
    left = list((tmp_path / "cache").glob("*/*"))
    assert not [p for p in left if p.name.startswith(".")]  # no temporary block file stays behind
    kept = [p.stat().st_size for p in left if p.name.isdigit()]  # only a block under the limit (the last) is kept
    assert kept == [] if fails == "rename" else all(n < 100 << 10 for n in kept) and len(kept) <= 1

"""Checkpoints read from a real S3 server (moto) and a static HTTP server: the same shards as from local
disk, and only about the bytes each rank needs fetched."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.cli import main
from reshard.errors import SourceChangedError
from reshard.io.rank_stream import RankStream
from reshard.io.source.opener import open_source
from reshard.io.source.remote_dir import SPECULATIVE
from reshard.plan.planner import make_plan


def _bytes(plan) -> bytes:
    with RankStream(plan) as stream:
        return b"".join(bytes(c) for c in stream.chunks())


@pytest.fixture(params=["s3", "http"])
def store(request, s3, web, s3_env):
    if request.param == "s3":
        return "s3", s3, "s3://ckpts/models/llama"
    return "http", web, f"{web.url}/files/llama/"


@pytest.mark.servers
@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_identical_to_local_and_fetch_only_what_they_need(store, local_root: Path, tp: int) -> None:
    kind, srv, url = store
    srv.reset()
    remote, manifest = open_source(url)
    opened = srv.reset()
    local, local_manifest = open_source(local_root / "llama")
    assert manifest.digest() == local_manifest.digest()
    # headers: one speculative read per file (both headers fit), plus index.json and config.json whole
    json_bytes = sum((local_root / "llama" / n).stat().st_size for n in ("config.json", "model.safetensors.index.json"))
    assert opened["bytes"] <= sum(min(SPECULATIVE, f.size) for f in local.files) + json_bytes + 4096  # + listing
    assert all(f.version for f in remote.files)  # identity from each object's ETag
    plan, ref = make_plan(remote, manifest, tp), make_plan(local, local_manifest, tp)
    for rp, lp in zip(plan.ranks, ref.ranks):
        got = _bytes(rp)
        fetched = srv.reset()
        assert got == _bytes(lp), f"{kind} rank {rp.rank} of tp={tp} differs from the local shard"
        planned = rp.stats()["bytes_read"]  # what the local stream preads (test_bytes_read_is_what_...)
        needed = sum(s.nbytes for t in rp.tensors for s in t.segments if s.file)
        assert needed <= fetched["bytes"] <= planned * 1.05, (kind, rp.rank, fetched, planned)
        # row-split tensors come as row blocks: far fewer GETs than their rows
        rows = sum(s.count for t in rp.tensors for s in t.segments if s.file and not s.contiguous)
        assert rows >= 256 and fetched["requests"] * 10 <= rows, (kind, rp.rank, fetched, rows)


@pytest.mark.pure
@pytest.mark.parametrize("tp", [2, 4])
def test_bytes_read_is_what_the_local_stream_preads(local_root: Path, monkeypatch, tp: int) -> None:
    from reshard.io.source.readers import LocalReader
    from reshard.plan.types import RankPlan

    read = []
    pread = LocalReader.pread
    monkeypatch.setattr(LocalReader, "pread", lambda self, dst, offset: (read.append(len(dst)), pread(self, dst, offset)))
    local, manifest = open_source(local_root / "llama")
    for rp in make_plan(local, manifest, tp).ranks:
        read.clear()
        with RankStream(rp, chunk_size=rp.size) as stream:  # one chunk: no piece cut at a chunk edge
            data = bytes(next(stream.chunks()))
        plain = RankPlan(rp.rank, rp.world, tuple(rp.tensors), rp.header, rp.files)  # stats tensor by tensor
        assert rp.stats()["bytes_read"] == plain.stats()["bytes_read"] == sum(read), (rp.rank, sum(read))
        segs = [s for t in rp.tensors for s in t.segments if s.file]
        rows = sum(s.count * s.stride for s in segs if not s.contiguous)  # the whole rows a row split touches
        assert sum(s.nbytes for s in segs) < sum(read) <= sum(s.nbytes for s in segs if s.contiguous) + rows
        with RankStream(rp, chunk_size=100_003) as stream:  # chunks cut pieces anywhere: same bytes
            assert b"".join(bytes(c) for c in stream.chunks()) == data


@pytest.mark.servers
def test_cli_write_from_store_matches_local(store, local_root: Path, tmp_path: Path) -> None:
    kind, _, url = store
    assert main(["write", url, "--tp", "2", "-o", str(tmp_path / "remote"), "--no-progress"]) == 0
    assert main(["write", str(local_root / "llama"), "--tp", "2", "-o", str(tmp_path / "local"), "--no-progress"]) == 0
    for name in ("rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "config.json"):
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name


@pytest.mark.servers
def test_object_replaced_mid_stream_fails_the_stream(store, local_root: Path, monkeypatch, boto, tmp_path) -> None:
    import reshard.io.source.prefetch as prefetch

    kind, _, url = store
    monkeypatch.setattr(prefetch, "WINDOW", 16 << 10)  # fetch ahead in small windows, so most is read later
    monkeypatch.setenv("RESHARD_STORE_INFLIGHT", str(32 << 10))
    remote, manifest = open_source(url)
    plan = make_plan(remote, manifest, 2).ranks[0]
    name = "model-00001-of-00002.safetensors"
    original = (local_root / "llama" / name).read_bytes()
    changed = original[:-4] + b"\x00\x00\x80\x7f"  # same size, another last value: only the ETag tells
    try:
        with RankStream(plan, chunk_size=16 << 10) as stream, pytest.raises(SourceChangedError, match=name):
            for i, _ in enumerate(stream.chunks()):
                if i == 0:
                    if kind == "s3":
                        boto.put_object(Bucket="ckpts", Key=f"models/llama/{name}", Body=changed)
                    else:
                        tmp = tmp_path / name
                        tmp.write_bytes(changed)
                        tmp.replace(local_root / "llama" / name)
    finally:
        if kind == "s3":
            boto.put_object(Bucket="ckpts", Key=f"models/llama/{name}", Body=original)
        else:
            (local_root / "llama" / name).write_bytes(original)


@pytest.mark.servers
@pytest.mark.parametrize("several", [False, True], ids=["one-range-GETs", "multi-range-GETs"])
def test_5xx_answers_are_retried(local_root: Path, monkeypatch, several: bool) -> None:
    from reshard.testing.local_servers import http_server

    monkeypatch.setenv("RESHARD_STORE_RETRIES", "9")  # a GET fails 10 times in a row once in 10**6
    monkeypatch.setenv("RESHARD_STORE_MULTIRANGE", str(several).lower())
    with http_server(local_root, fail_every=2 if several else 4) as flaky:  # every 2nd/4th request answers 503
        remote, manifest = open_source(f"{flaky.url}/files/llama/")
        got = [_bytes(rp) for rp in make_plan(remote, manifest, 2).ranks]
        counts = flaky.counts()
    local, local_manifest = open_source(local_root / "llama")
    assert got == [_bytes(rp) for rp in make_plan(local, local_manifest, 2).ranks]
    assert counts["failed"] >= counts["requests"] // (2 if several else 4) > 5


@pytest.mark.servers
def test_a_remote_reader_is_built_with_its_fetch_ahead(web, local_root: Path) -> None:
    """A store object's reader is built with its fetch-ahead and adds itself to it (nothing sets it from
    outside): what the fetch-ahead holds is read from it, the rest by a GET of its own."""
    from reshard.io.source.readers import RemoteReader

    remote, manifest = open_source(f"{web.url}/files/llama/")
    path, key = next(iter(make_plan(remote, manifest, 2).ranks[0].files.items()))
    data = (local_root / "llama" / path.rsplit("/", 1)[1]).read_bytes()

    class Ahead:  # holds bytes [100, 150) of the object
        def __init__(self) -> None:
            self.readers: list[RemoteReader] = []

        def add(self, reader: RemoteReader) -> None:
            self.readers.append(reader)

        def copy(self, p: str, offset: int, dst: memoryview) -> bool:
            if p != path or offset < 100 or offset + len(dst) > 150:
                return False
            dst[:] = data[offset : offset + len(dst)]
            return True

    ahead = Ahead()
    reader = RemoteReader(path, key, fetch_ahead=ahead)
    assert ahead.readers == [reader] and reader.fetch_ahead is ahead
    web.reset()
    buf = memoryview(bytearray(50))
    reader.pread(buf, 100)
    assert bytes(buf) == data[100:150] and web.reset()["requests"] == 0  # from the fetch-ahead
    reader.pread(buf, 150)
    assert bytes(buf) == data[150:200] and web.reset()["requests"] == 1  # not fetched ahead: one GET
    alone = RemoteReader(path, key)
    assert alone.fetch_ahead is None and alone.multi is None
    alone.pread(buf, 100)
    assert bytes(buf) == data[100:150] and web.reset()["requests"] == 1


@pytest.mark.pure
def test_readers_and_prefetch_import_each_other_only_for_types() -> None:
    """readers.py names the fetch-ahead by a protocol of its own and never imports prefetch.py;
    prefetch.py imports readers.py for its types only."""
    import ast

    import reshard.io.source.prefetch as prefetch
    import reshard.io.source.readers as readers

    def imports(module: object) -> tuple[set[str], set[str]]:
        """(modules imported at run time, modules imported under `if TYPE_CHECKING`)."""
        tree = ast.parse(Path(str(getattr(module, "__file__", ""))).read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        runtime, types = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                (types if id(node) in typing_only else runtime).add(node.module)
        return runtime, types

    assert "reshard.io.source.prefetch" not in set().union(*imports(readers))
    runtime, types = imports(prefetch)
    assert "reshard.io.source.readers" not in runtime and "reshard.io.source.readers" in types

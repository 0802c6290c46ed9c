"""`reshard serve --root s3://...|http://...` reads its store through the node's block cache
(`reshard.io.source.store_cache`): against moto's S3 and a static HTTP server, concurrent pulls of every rank
of two layouts, in two worker processes, fetch each block once; the cache stays within its size; an
object replaced in the store is never served from its old blocks; `/metrics` counts the store bytes; a
block whose worker is SIGKILLed as it writes it leaves no temp file once a replacement has started."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.cli import main
from reshard.io.sealed import TRAILER
from tests.support.hard import Created, ThrottledProxy, metric, wait_for, workers
from tests.support.live import LiveServer, live_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

BLOCK = 16 << 10  # small blocks: the test checkpoint's files (~230 KB) are 15 blocks each
NOISE = 8 << 10  # store bytes per request that are not blocks: a listing (S3) or 1-byte stats and 404s (HTTP)
LAYOUTS = ((2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3))


@pytest.fixture(params=["s3", "http"])
def store(request: pytest.FixtureRequest, s3: Any, web: Any, s3_env: Any) -> tuple[str, Any, str]:
    if request.param == "s3":
        return "s3", s3, "s3://ckpts/models"
    return "http", web, f"{web.url}/files"


def _written(local_root: Path, name: str, tp: int, out: Path) -> Path:
    d = out / f"{name}-tp{tp}"
    if not d.exists():
        assert main(["write", str(local_root / name), "--tp", str(tp), "-o", str(d), "--no-progress"]) == 0
    return d


def _pull_all(srv: LiveServer, name: str, pulls: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
    """Every (tp, rank) of `pulls` at once, one thread each."""
    got: dict[tuple[int, int], bytes] = {}

    def pull(tp: int, rank: int) -> None:
        r = httpx.get(f"{srv.ckpt_url(name)}/shards/{rank}", params={"tp": tp}, timeout=120)
        assert r.status_code == 200, r.text
        got[(tp, rank)] = r.content

    threads = [threading.Thread(target=pull, args=p) for p in pulls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def _blocks(cache: Path) -> dict[str, int]:
    """Block -> the object bytes it holds (its file, less the seal: `reshard.io.sealed`)."""
    return {str(p.relative_to(cache)): p.stat().st_size - TRAILER for p in cache.glob("*/*") if p.name.isdigit()}


def test_every_block_is_fetched_once_for_all_ranks_and_layouts(store: tuple[str, Any, str], local_root: Path,
                                                               tmp_path: Path) -> None:
    kind, srv, root = store
    cache = tmp_path / "cache"
    files = sum(p.stat().st_size for p in (local_root / "llama").glob("*.safetensors"))
    json_files = sum(p.stat().st_size for p in (local_root / "llama").glob("*.json"))  # read whole by each worker
    srv.reset()
    with live_server(root, log_dir=tmp_path, workers=2, store_cache=1 << 30, store_cache_block=BLOCK,  # type: ignore[arg-type]
                     store_cache_dir=cache) as serve:
        pulls = [*LAYOUTS, *LAYOUTS[:2]]  # two ranks asked for twice at once, by two workers
        got = _pull_all(serve, "llama", pulls)
        for (tp, rank), data in got.items():
            want = _written(local_root, "llama", tp, tmp_path) / f"rank-{rank:05d}-of-{tp:05d}.safetensors"
            assert data == want.read_bytes(), (kind, tp, rank)
        counts = srv.reset()
        blocks = _blocks(cache)
        assert sum(blocks.values()) == files  # every block of both files is cached, once
        # headers and data alike come through the cache: each byte of the weights once, for both workers
        assert files <= counts["bytes"] <= files + 2 * json_files + NOISE * len(pulls), (kind, counts, files)
        fetched = metric(serve, "reshard_store_fetched_bytes_total")
        assert files <= fetched <= counts["bytes"], (fetched, counts)  # the service counts what it fetched
        again = _pull_all(serve, "llama", list(LAYOUTS))  # every byte now comes from the cache
        assert again == {k: got[k] for k in LAYOUTS}
        assert srv.reset()["bytes"] <= NOISE * len(LAYOUTS)
        assert metric(serve, "reshard_store_cache_hit_bytes_total") >= 2 * files
        assert serve.alive() and "Traceback" not in serve.log(), serve.log()


def test_the_cache_stays_within_its_size(store: tuple[str, Any, str], local_root: Path, tmp_path: Path) -> None:
    kind, srv, root = store
    cache, limit = tmp_path / "cache", 5 * BLOCK
    with live_server(root, log_dir=tmp_path, store_cache=limit, store_cache_block=BLOCK,  # type: ignore[arg-type]
                     store_cache_dir=cache) as serve:
        srv.reset()
        for tp, rank in LAYOUTS[:3]:
            got = _pull_all(serve, "llama", [(tp, rank)])[(tp, rank)]
            want = _written(local_root, "llama", tp, tmp_path) / f"rank-{rank:05d}-of-{tp:05d}.safetensors"
            assert got == want.read_bytes()
            # fetches ahead of the stream may still be landing after its last byte: each sweeps on landing
            assert wait_for(lambda: 0 < sum(_blocks(cache).values()) <= limit, timeout=10), _blocks(cache)
        files = sum(p.stat().st_size for p in (local_root / "llama").glob("*.safetensors"))
        assert srv.reset()["bytes"] > 2 * files  # evicted blocks were fetched again, and served right


def test_a_replaced_object_is_never_served_from_its_old_blocks(store: tuple[str, Any, str], local_root: Path,
                                                               boto: Any, tmp_path: Path) -> None:
    kind, srv, root = store
    src, name = local_root / "llama", "model-00001-of-00002.safetensors"
    work = tmp_path / "ckpts" / "mutable"
    shutil.copytree(src, work)
    put = _putter(kind, boto, local_root)
    for p in sorted(work.iterdir()):
        put(p, p.name)
    try:
        with live_server(root, log_dir=tmp_path, store_cache=1 << 30, store_cache_block=BLOCK,  # type: ignore[arg-type]
                         store_cache_dir=tmp_path / "cache") as serve:
            before = _pull_all(serve, "mutable", [(1, 0)])[(1, 0)]  # tp=1: every byte of the checkpoint
            assert before == (_written(tmp_path / "ckpts", "mutable", 1, tmp_path / "a") /
                              "rank-00000-of-00001.safetensors").read_bytes()
            data = bytearray((work / name).read_bytes())
            data[-4:] = b"\x00\x00\x80\x7f"  # same size, another last value: only the ETag tells
            (work / name).write_bytes(bytes(data))
            put(work / name, name)
            srv.reset()
            after = _pull_all(serve, "mutable", [(1, 0)])[(1, 0)]
            want = (_written(tmp_path / "ckpts", "mutable", 1, tmp_path / "b") / "rank-00000-of-00001.safetensors")
            assert after == want.read_bytes() and after != before
            assert srv.reset()["bytes"] >= BLOCK  # the new version's blocks came from the store
    finally:
        if kind == "http":
            shutil.rmtree(local_root / "mutable", ignore_errors=True)


def _putter(kind: str, boto: Any, local_root: Path) -> Any:
    """put(path, name): the file as object `name` of checkpoint `mutable` in the store."""
    if kind == "s3":
        return lambda path, name: boto.upload_file(str(path), "ckpts", f"models/mutable/{name}")

    def put(path: Path, name: str) -> None:
        dest = local_root / "mutable" / name
        dest.parent.mkdir(exist_ok=True)
        tmp = dest.with_name(f".{name}.tmp")
        shutil.copyfile(path, tmp)
        st = os.stat(tmp)
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime: Starlette's ETag changes
        tmp.replace(dest)

    return put


BLOCK_TEMP = re.compile(r"\.\d+\.(\d+)-\d+\.\d+")  # reshard.io.source.store_cache: .K.PID-START.THREAD


def test_a_block_cut_by_a_killed_worker_is_removed_by_its_replacement(web: Any, local_root: Path,
                                                                      tmp_path: Path) -> None:
    """The worker writing a cached block is SIGKILLed the moment the block's temp file appears (the store
    is slowed down, so the test sees the block's directory before the fetch ends). Before, such a temp
    file stayed an hour, outside the cache's size; now the replacement worker removes it at its start,
    and the shard is served whole from the cache and the store."""
    cache = tmp_path / "cache"
    host, port = web.url.removeprefix("http://").split(":")
    with ThrottledProxy((host, int(port)), rate=512 << 10) as slow, \
            live_server(f"{slow.url}/files", log_dir=tmp_path, workers=2, store_cache=1 << 30,  # type: ignore[arg-type]
                        store_cache_block=64 << 10, store_cache_dir=cache) as serve:
        with Created(cache) as made:
            pull = threading.Thread(target=_pull_quietly, args=(f"{serve.ckpt_url('llama')}/shards/0?tp=2",))
            pull.start()
            sub = made.wait_for(lambda name: (cache / name).is_dir(), timeout=60)
            assert sub is not None, sorted(os.listdir(cache))
            with Created(cache / sub) as blocks:
                temp = blocks.wait_for(BLOCK_TEMP.fullmatch, timeout=60)
                assert temp is not None, sorted(os.listdir(cache / sub))
                pid = int(BLOCK_TEMP.fullmatch(temp).group(1))  # type: ignore[union-attr]
                os.kill(pid, signal.SIGKILL)
            pull.join(120)
        assert wait_for(lambda: pid not in workers(serve) and len(workers(serve)) == 2, timeout=60), serve.log()
        assert wait_for(lambda: not (cache / sub / temp).exists(), timeout=30), sorted(os.listdir(cache / sub))
        got = _pull_all(serve, "llama", [(2, 0)])[(2, 0)]
        assert got == (_written(local_root, "llama", 2, tmp_path) / "rank-00000-of-00002.safetensors").read_bytes()
        left = [p.name for p in cache.glob("*/.*")]
        assert left == [], left  # every temp file was renamed into a block or removed
        assert serve.alive() and "Traceback" not in serve.log(), serve.log()


def _pull_quietly(url: str) -> None:
    """A whole pull whose worker may die under it."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.get(url, timeout=120)

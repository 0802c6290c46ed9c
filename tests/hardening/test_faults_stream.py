"""Faults while bytes are in flight: clients vanishing mid-stream (50 times), a `reshard pull` killed
halfway and resumed, a source file replaced or rewritten while it is being served."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.errors import IntegrityError
from reshard.format.rank_file import rank_file_name
from reshard.io.client.shard_client import ShardClient
from tests.support.hard import ThrottledProxy, fd_count, live_server, metric, process_tree, rss_anon, wait_for
from tests.support.live import BIG, REPO, LiveServer, make_ckpt

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _open_stream(srv: LiveServer, target: str, *, rcvbuf: int | None = None) -> tuple[socket.socket, int, bytes]:
    """Send a GET, read up to the end of the headers: (socket, Content-Length, first body bytes)."""
    s = socket.socket()
    if rcvbuf:  # a small receive window keeps the server from running far ahead of what was read
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(_host_port(srv.url))
    s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    m = re.search(rb"content-length: (\d+)", head, re.I)
    assert m is not None
    return s, int(m.group(1)), body


def _read_rest(s: socket.socket, body: bytes, size: int) -> bytes:
    """Read until `size` body bytes or the server closes the connection."""
    parts = [body]
    n = len(body)
    while n < size:
        try:
            chunk = s.recv(1 << 20)
        except ConnectionResetError:
            break
        if not chunk:
            break
        parts.append(chunk)
        n += len(chunk)
    return b"".join(parts)


# --- clients that disconnect mid-stream --------------------------------------------------------------------

def _abandon(srv: LiveServer, target: str, i: int) -> None:
    """One stream abandoned in one of four ways: right after the request, after the headers, after about
    a megabyte, or with a TCP reset (SO_LINGER 0) mid-body."""
    s = socket.create_connection(_host_port(srv.url), timeout=30)
    try:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        mode = i % 4
        if mode == 0:
            return
        got = s.recv(65536)
        while mode >= 2 and len(got) < (1 << 20):
            got += s.recv(1 << 20)
        if mode == 3:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    finally:
        s.close()


def _settled(srv: LiveServer) -> bool:
    return metric(srv, "reshard_active_streams") == 0


def test_fifty_disconnects_leak_nothing(server: LiveServer, written: Any) -> None:
    target = f"/v1/checkpoints/{BIG}/shards/0?tp=1"  # ~56 MB: never sent completely
    pid = server.proc.pid
    for i in range(4):  # warm up: thread pools, caches, the plan of this shard
        _abandon(server, target, i)
    assert wait_for(lambda: _settled(server))
    time.sleep(0.3)
    fds0, rss0 = fd_count(pid), rss_anon(pid)
    outcomes0 = {o: metric(server, f'reshard_shard_streams_total{{outcome="{o}"}}')
                 for o in ("complete", "disconnected", "error")}

    with ThreadPoolExecutor(10) as pool:  # 5 waves of 10 clients vanishing at once
        for wave in range(5):
            list(pool.map(lambda i: _abandon(server, target, i), range(wave * 10, wave * 10 + 10)))
    assert wait_for(lambda: _settled(server)), "streams still open after every client left"
    outcomes = {o: metric(server, f'reshard_shard_streams_total{{outcome="{o}"}}') - outcomes0[o] for o in outcomes0}
    assert outcomes == {"complete": 0, "disconnected": 50, "error": 0}, outcomes

    assert wait_for(lambda: fd_count(pid) <= fds0, timeout=10), (fd_count(pid), fds0, os.listdir(f"/proc/{pid}/fd"))
    assert wait_for(lambda: rss_anon(pid) <= rss0 + (24 << 20), timeout=10), (rss_anon(pid) >> 20, rss0 >> 20)
    print(f"\n50 disconnects: fds {fds0} -> {fd_count(pid)}, RssAnon {rss0 / 2**20:.1f} -> {rss_anon(pid) / 2**20:.1f} MiB")

    want = (written(BIG, 2) / rank_file_name(1, 2)).read_bytes()
    with ShardClient(server.ckpt_url(BIG)) as client:  # sha256-verified against the server's digest
        assert hashlib.sha256(client.read_shard(1, 2)).digest() == hashlib.sha256(want).digest()
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert _settled(server)


@pytest.mark.parametrize("path", ["hashing", "sendfile"])
def test_client_that_stops_reading_is_dropped(tmp_path: Path, path: str) -> None:
    """A client that reads the headers and then nothing (and never hangs up) holds the stream only for
    `send_timeout` seconds: then its files and buffers are freed, and everyone else is served. The
    first download of a shard is read and hashed on the way; once its digest is known the kernel
    sends it (`sendfile`): both stall the same way."""
    root = tmp_path / "root"
    make_ckpt(root / "ck", seed=3, **SWAP)  # ~34 MB shard: far more than the socket buffers hold
    with live_server(root, chunk_size=64 << 10, send_timeout=1) as srv:
        target = "/v1/checkpoints/ck/shards/0?tp=1"
        if path == "sendfile":
            assert httpx.get(srv.url + target.replace("?", "/digest?"), timeout=60).status_code == 200
        s, size, _ = _open_stream(srv, target, rcvbuf=4096)
        try:
            assert wait_for(lambda: metric(srv, "reshard_active_streams") == 1, timeout=10)
            t0 = time.monotonic()
            assert wait_for(lambda: _settled(srv), timeout=20), "the stalled stream was never dropped"
            assert time.monotonic() - t0 < 15
            assert metric(srv, 'reshard_shard_streams_total{outcome="timeout"}') == 1
            got = httpx.get(srv.url + target, timeout=60)  # others are served while the socket still dangles
            assert got.status_code == 200 and len(got.content) == size
            assert metric(srv, 'reshard_shard_streams_total{outcome="complete"}') == 1
            assert (metric(srv, "reshard_shard_bytes_sendfile_total") > 0) == (path == "sendfile")
        finally:
            s.close()
        assert "dropped: the client took no data for 1 s" in srv.log()
        assert "Traceback" not in srv.log(), srv.log()


# --- a pull killed halfway, then resumed -------------------------------------------------------------------

def test_killed_pull_resumes_to_identical_file(server: LiveServer, written: Any, tmp_path: Path) -> None:
    want_path = written(BIG, 2) / rank_file_name(0, 2)
    want = want_path.read_bytes()  # ~28 MB
    record = json.loads((want_path.parent / "reshard.json").read_text())
    dest = tmp_path / "rank0.safetensors"
    part = dest.with_name(f".{dest.name}.part")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with ThrottledProxy(_host_port(server.url), rate=8e6) as proxy:  # ~3.5 s for the whole shard
        argv = [sys.executable, "-m", "reshard.cli", "pull", f"{proxy.url}/v1/checkpoints/{BIG}", "--rank", "0",
                "--tp", "2", "-o", str(dest), "--no-progress"]
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert wait_for(lambda: part.exists() and part.stat().st_size >= len(want) // 4 or proc.poll() is not None,
                            timeout=60, step=0.005)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        assert not dest.exists()
        kept = part.stat().st_size
        assert 0 < kept < len(want), kept
        assert want.startswith(part.read_bytes())  # what was written before the kill is a correct prefix
        proxy.rate = 1e12  # the rerun goes through the same URL (the partial file is tied to it), at full speed
        rerun = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert ", resumed at " in rerun.stdout, (rerun.stdout, rerun.stderr)  # the result, on stdout
    got = dest.read_bytes()
    assert got == want
    assert hashlib.sha256(got).hexdigest() == record["files"][want_path.name]["sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name]  # no .part or .part.json left


# --- a source file replaced or rewritten while it is served ------------------------------------------------

SWAP = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2, "vocab_size": 2048,
        "num_attention_heads": 8, "num_key_value_heads": 8}  # ~34 MB, one file


@pytest.fixture(scope="module")
def swap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server over a root whose checkpoint `swap` has two versions (old/new, same shapes) at hand,
    with the tp=1 shard of each as `reshard write` writes it."""
    from reshard.cli import main

    base = tmp_path_factory.mktemp("swap")
    versions = {}
    for seed, label in ((0, "old"), (1, "new")):
        src = make_ckpt(base / label, seed=seed, **SWAP)
        assert main(["write", str(src), "--tp", "1", "-o", str(base / f"{label}-tp1"), "--no-progress"]) == 0
        versions[label] = (base / f"{label}-tp1" / rank_file_name(0, 1)).read_bytes()
    root = base / "root"
    root.mkdir()
    with live_server(root, chunk_size=64 << 10) as srv, live_server(root, chunk_size=64 << 10, zero_copy=False) as copying:
        yield {"srv": srv, "copying": copying, "root": root, "base": base, **versions}
        for s in (srv, copying):
            assert s.alive() and "Traceback" not in s.log(), s.log()


def _install(swap: dict[str, Any], name: str) -> Path:
    shutil.copytree(swap["base"] / "old", swap["root"] / name)
    return swap["root"] / name / "model.safetensors"


def test_replaced_by_rename_mid_stream(swap: dict[str, Any]) -> None:
    srv, old, new = swap["srv"], swap["old"], swap["new"]
    weights = _install(swap, "renamed")
    url = srv.ckpt_url("renamed") + "/shards/0"
    etag_old = httpx.head(url, params={"tp": 1}).headers["etag"]
    staged = weights.with_name(".incoming.safetensors")
    shutil.copyfile(swap["base"] / "new" / "model.safetensors", staged)
    s, size, body = _open_stream(srv, "/v1/checkpoints/renamed/shards/0?tp=1", rcvbuf=64 << 10)
    with s:
        while len(body) < (1 << 20):
            body += s.recv(1 << 16)
        os.replace(staged, weights)  # how checkpoints are published: the old file stays open, unchanged
        body = _read_rest(s, body, size)
    assert size == len(old)
    assert body == old, "not the old version, complete"  # its file stays open and unchanged: no need to cut
    r = httpx.get(url, params={"tp": 1}, timeout=60)
    assert r.status_code == 200 and r.headers["etag"] != etag_old and r.content == new
    resumed = httpx.get(url, params={"tp": 1}, headers={"Range": "bytes=1000-", "If-Range": etag_old}, timeout=60)
    assert resumed.status_code == 200 and resumed.content == new  # a stale If-Range gets the whole new file


@pytest.mark.parametrize("zero_copy", [True, False], ids=["sendfile", "copying"])
def test_rewritten_in_place_mid_stream_cuts_the_body(swap: dict[str, Any], zero_copy: bool) -> None:
    """A tensor file rewritten in place mid-stream: the body is cut short and counted as an error. The
    bytes received before the rewrite are the old version's; after it, a copying server still sends
    only old bytes, while sendfile (as any sendfile server) may already have handed the kernel pages
    that the rewrite changed, so a client must never take a short body (its length tells it)."""
    srv, old, new = swap["srv" if zero_copy else "copying"], swap["old"], swap["new"]
    name = f"inplace-{zero_copy}"
    weights = _install(swap, name)
    url = srv.ckpt_url(name) + "/shards/0"
    etag_old = httpx.head(url, params={"tp": 1}).headers["etag"]
    httpx.get(url + "/digest", params={"tp": 1}, timeout=60)  # known digest: the body is not hashed on the way
    errors0 = metric(srv, 'reshard_shard_streams_total{outcome="error"}')
    sendfile0 = metric(srv, "reshard_shard_bytes_sendfile_total")
    fresh = (swap["base"] / "new" / "model.safetensors").read_bytes()
    s, size, body = _open_stream(srv, f"/v1/checkpoints/{name}/shards/0?tp=1", rcvbuf=64 << 10)
    with s:
        while len(body) < (1 << 20):
            body += s.recv(1 << 16)
        before = len(body)
        with open(weights, "r+b") as f:  # same size, other bytes, a new mtime: tensors rewritten in place
            f.write(fresh)
        body = _read_rest(s, body, size)
    assert len(body) < size, "a complete body was sent although the source changed under it"
    assert body[:before] == old[:before]
    if not zero_copy:
        assert body == old[: len(body)], "the body mixes two versions"
    assert wait_for(lambda: metric(srv, 'reshard_shard_streams_total{outcome="error"}') == errors0 + 1)
    # the server sends by sendfile or not at all (a range: not hashed on the way); whether a range of
    # the cut stream itself completed before the check that cut it depends on timing
    part = httpx.get(url, params={"tp": 1}, headers={"Range": "bytes=1-"}, timeout=60)
    assert part.status_code == 206 and part.content == new[1:]
    assert (metric(srv, "reshard_shard_bytes_sendfile_total") > sendfile0) == zero_copy
    r = httpx.get(url, params={"tp": 1}, timeout=60)
    assert r.status_code == 200 and r.headers["etag"] != etag_old and r.content == new
    assert httpx.get(srv.url + "/healthz").status_code == 200


def test_truncated_under_a_row_split_stream(swap: dict[str, Any]) -> None:
    """A row-split shard is gathered from a leased mapping of its file in the server: truncating and
    rewriting the file in place mid-stream makes the server give the lease back at once (the writer
    is not held for the kernel's 45 s), cuts the body, and never faults the server (SIGBUS)."""
    srv = swap["srv"]
    weights = _install(swap, "rowcut")
    (weights.parent / "reshard-rules.json").write_text(json.dumps({"rules": [{"pattern": "*_proj.weight", "kind": "row"}]}))
    fresh = (swap["base"] / "new" / "model.safetensors").read_bytes()
    errors0 = metric(srv, 'reshard_shard_streams_total{outcome="error"}')
    s, size, body = _open_stream(srv, "/v1/checkpoints/rowcut/shards/0?tp=2", rcvbuf=64 << 10)
    with s:

        def mapped() -> bool:
            return any(str(weights) in Path(f"/proc/{p}/maps").read_text() for p in process_tree(srv.proc.pid))

        while not mapped() and len(body) < size // 2:  # past the embedding, into the row-split matrices
            body += s.recv(1 << 16)
        assert mapped(), "the server does not map the file"
        t0 = time.monotonic()
        with open(weights, "wb") as f:  # O_TRUNC: every mapped page of the old contents goes
            f.write(fresh)
        waited = time.monotonic() - t0
        body = _read_rest(s, body, size)
    assert waited < 10, f"the writer was held {waited:.1f} s"
    assert len(body) < size
    assert wait_for(lambda: metric(srv, 'reshard_shard_streams_total{outcome="error"}') == errors0 + 1)
    assert srv.alive() and httpx.get(srv.url + "/healthz").status_code == 200
    r = httpx.get(srv.ckpt_url("rowcut") + "/shards/0", params={"tp": 2}, timeout=60)
    assert r.status_code == 200 and len(r.content) == int(r.headers["content-length"])


def test_client_refuses_mixed_bytes(swap: dict[str, Any]) -> None:
    """`ShardClient` reading through a slow link while the file is rewritten: IntegrityError, never the
    mixed bytes; afterwards it reads the new version."""
    srv, new = swap["srv"], swap["new"]
    weights = _install(swap, "client")
    fresh = (swap["base"] / "new" / "model.safetensors").read_bytes()
    with ThrottledProxy(_host_port(srv.url), rate=6e6, rcvbuf=64 << 10) as proxy:
        client = ShardClient(f"{proxy.url}/v1/checkpoints/client", backoff=0.01)
        received, rewritten = 0, False
        with pytest.raises(IntegrityError, match="changed on the server"):
            for piece in client.iter_shard(0, 1):
                received += len(piece)
                if received >= (2 << 20) and not rewritten:
                    with open(weights, "r+b") as f:
                        f.write(fresh)
                    rewritten = True
        assert (2 << 20) <= received < len(new)
    with ShardClient(srv.ckpt_url("client")) as direct:
        assert direct.read_shard(0, 1) == new

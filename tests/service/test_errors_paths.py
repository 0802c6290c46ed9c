"""Error answers name no server path (`reshard.service.http_errors.ServerPaths`): what is under the root
relative to it, the output / state / gather directories by name, anything else as `.../last part`; a
full disk answered from a real `reshard serve --workers 2` (an ext4 image with no block left) shows
none of the mount's paths and logs no traceback. Also: `HEAD /healthz`, the head-limit settings and
flags, and the protocol factory that every worker gets."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.errors import NoSpaceError, ReadOnlyError
from reshard.service.http_errors import ServerPaths, response_for, typed
from tests.support import hard
from tests.support.fs import Mount, mounted
from tests.support.live import make_ckpt

RULES = {"rules": [{"pattern": "*", "kind": "replicate"}]}


# --- pure: the rewriting --------------------------------------------------------------------------

@pytest.mark.pure
@pytest.mark.parametrize(("text", "shown"), [
    ("needs 3.0 MB in /srv/root/up, 1.0 MB free", "needs 3.0 MB in up, 1.0 MB free"),
    ("/srv/root: read-only file system", "ROOT: read-only file system"),
    ("/srv/root/.reshard/out/ck/tp-2: no space left", "OUT/ck/tp-2: no space left"),  # the innermost wins
    ("/var/lib/state/jobs.db is locked", "STATE/jobs.db is locked"),
    ("'/srv/root/ck/model.safetensors': bad", "'ck/model.safetensors': bad"),
    ("in /srv/root.", "in ROOT."),
    ("/srv/root2/x: no", ".../x: no"),  # not the root: another path of the server
    ("/tmp/elsewhere/a.json: no space left on device", ".../a.json: no space left on device"),
    ("(/usr/lib/x)", "(.../x)"),
    ("no route GET /v1/checkpoints/x", "no route GET /v1/checkpoints/x"),  # /v1 is no directory here
    ("see http://host/tmp/x and s3://bucket/tmp/y", "see http://host/tmp/x and s3://bucket/tmp/y"),
    ("tp 1/2, a/b/c", "tp 1/2, a/b/c"),
])
def test_server_paths_hide(text: str, shown: str) -> None:
    paths = ServerPaths([("/srv/root", "ROOT", ""), ("/srv/root/.reshard/out", "OUT", "OUT/"),
                         ("/var/lib/state", "STATE", "STATE/")])
    assert paths.hide(text) == shown


@pytest.mark.pure
def test_server_paths_of_settings(tmp_path: Path) -> None:
    from reshard.service.serve_settings import Settings

    (tmp_path / "root").mkdir()
    s = Settings(root=tmp_path / "root", out=tmp_path / "out", state=tmp_path / "st", gather_dir=tmp_path / "g")
    paths = ServerPaths.of(s)
    text = f"{tmp_path}/root/ck/a; {tmp_path}/out/ck/tp-2; {tmp_path}/st/x.db; {tmp_path}/g/p; {tmp_path}/other"
    assert paths.hide(text) == "ck/a; OUT/ck/tp-2; STATE/x.db; GATHER_DIR/p; .../other"
    store = Settings(root="http://127.0.0.1:1/files", out=tmp_path / "out")
    assert ServerPaths.of(store).hide(f"{store.state_dir}/rules/ck: x") == "CACHE/rules/ck: x"


@pytest.mark.pure
def test_paths_with_spaces_are_hidden_whole(tmp_path: Path) -> None:
    """A path of the server with spaces in it: none of its directories shows, whether it is one of the
    service's own (OUT...) or another (where a space used to end the path: `.../my` + ` models/x`)."""
    from reshard.service.serve_settings import Settings

    base = tmp_path / "my models"
    (base / "root").mkdir(parents=True)
    (base / "sub dir").mkdir()
    s = Settings(root=base / "root", out=base / "job out")
    text = (f"{base}/job out/ck/tp-2: full; {base}/root/ck/a b.json: bad; {base}/sub dir/rank 0.safetensors: "
            f"no space left (in {base}/sub dir); {base}/sub dir is missing")
    assert ServerPaths.of(s).hide(text) == ("OUT/ck/tp-2: full; ck/a b.json: bad; .../rank 0.safetensors: no space "
                                            "left (in .../sub dir); .../sub dir is missing")
    for part in ("my models", "sub dir/", str(tmp_path)):
        assert part not in ServerPaths.of(s).hide(text).replace(".../sub dir", "")


@pytest.mark.pure
def test_unnamed_os_errors_are_typed_without_a_path_or_free_space() -> None:
    """A write into an open file fails without a file name: no path to show, and no free-space figure
    (the old answer gave the free space of the server's working directory)."""
    err = typed(OSError(errno.ENOSPC, "No space left on device"))
    assert isinstance(err, NoSpaceError) and "MB free" not in str(err) and "server's disk" in str(err)
    assert isinstance(typed(OSError(errno.EROFS, "Read-only file system")), ReadOnlyError)
    body = json.loads(response_for(OSError(errno.ENOSPC, "No space", "/tmp/x/y/rank.safetensors")).body)
    assert body["error"] == "NoSpaceError" and body["detail"].startswith(".../rank.safetensors: no space"), body


@pytest.mark.pure
def test_head_healthz_in_process(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from reshard.service.api.app import create_app
    from reshard.service.serve_settings import Settings

    with TestClient(create_app(Settings(root=tmp_path, token="t"))) as c:
        get, head = c.get("/healthz"), c.head("/healthz")
        assert (get.status_code, head.status_code) == (200, 200)
        assert head.content == b"" and head.headers["content-length"] == str(len(get.content))
        assert "head" not in c.get("/openapi.json", headers={"Authorization": "Bearer t"}).json()["paths"]["/healthz"]


@pytest.mark.pure
def test_head_limit_settings_flags_and_protocol(tmp_path: Path) -> None:
    import argparse

    from reshard.cli.serve import _settings, add_commands
    from reshard.service.process.workers import http_protocol, uvicorn_options
    from reshard.service.transport.protocol import BoundedProtocol, HeadLimits
    from reshard.service.transport.zerocopy import ZeroCopyProtocol

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["serve", "--root", str(tmp_path), "--max-header-bytes", "4096", "--max-headers", "20",
                              "--max-url-bytes", "1024", "--keep-alive-timeout", "2.5", "--no-zero-copy"])
    s = _settings(args)
    assert (s.max_header_bytes, s.max_headers, s.max_url_bytes, s.keep_alive_timeout) == (4096, 20, 1024, 2.5)
    factory = http_protocol(s)
    assert factory.func is BoundedProtocol and factory.keywords["limits"] == HeadLimits(4096, 20, 1024, 2.5)
    again = pickle.loads(pickle.dumps(factory))  # what a spawned worker receives
    assert again.func is BoundedProtocol and again.keywords == factory.keywords
    assert http_protocol(s.model_copy(update={"zero_copy": True})).func is ZeroCopyProtocol
    assert uvicorn_options(s)["timeout_keep_alive"] == 2.5
    defaults = _settings(parser.parse_args(["serve", "--root", str(tmp_path)]))
    assert HeadLimits.from_settings(defaults) == HeadLimits()  # 64 KiB, 100 headers, 8 KiB, 30 s


# --- a real server on a full disk ------------------------------------------------------------------

@pytest.fixture(scope="module")
def ext4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    with mounted("ext4", tmp_path_factory.mktemp("paths") / "ext4", size_mb=16) as m:
        yield m


def _no_server_path(r: httpx.Response, *paths: Path) -> dict[str, Any]:
    body = r.json()
    for p in paths:
        assert str(p) not in r.text and os.path.realpath(p) not in r.text, body
    assert "/" + str(paths[0]).split("/")[1] + "/" not in body["detail"], body  # no absolute path at all
    return body


@pytest.mark.servers
def test_full_disk_answers_name_no_server_path(ext4: Mount, tmp_path: Path) -> None:
    """The root and --out on an ext4 with no block left: storing a manifest (a new directory under
    ROOT/.reshard) and an upload answer 507 naming ROOT-relative paths; the old answer to the first was
    `/.../root/.reshard: no space left on device`, with a traceback in the server's log."""
    root, out = ext4.path / "root", ext4.path / "out"
    make_ckpt(root / "ck")
    try:
        with hard.live_server(root, out=out, log_dir=tmp_path, state=tmp_path / "state") as srv:
            ext4.fill(leave=0)
            r = httpx.put(srv.ckpt_url("ck") + "/rules", json=RULES, timeout=30)
            assert r.status_code == 507, r.text
            body = _no_server_path(r, ext4.path, root, out)
            assert body["error"] == "NoSpaceError" and body["detail"].startswith(".reshard"), body
            r = httpx.put(srv.ckpt_url("up") + "/files/model.safetensors", content=b"x" * 100_000, timeout=30)
            assert r.status_code == 507 and _no_server_path(r, ext4.path, root)["detail"].startswith("needs "), r.text
            ext4.unfill()
            assert httpx.put(srv.ckpt_url("ck") + "/rules", json=RULES, timeout=30).status_code == 200
            assert srv.alive() and "Traceback" not in srv.log(), srv.log()
    finally:
        ext4.unfill()
        ext4.clean()


@pytest.mark.servers
def test_full_cache_of_a_store_root_names_no_server_path(ext4: Mount, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A root over plain HTTP keeps its stored manifests in $XDG_CACHE_HOME/reshard/...: with that on
    the full disk the answer used to be `/.../cache: no space left on device`."""
    from reshard.testing.local_servers import http_server

    make_ckpt(tmp_path / "web" / "ck")
    cache = ext4.path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    try:
        with http_server(tmp_path / "web") as web, \
                hard.live_server(web.url + "/files", log_dir=tmp_path, out=tmp_path / "out",  # type: ignore[arg-type]
                                 state=tmp_path / "state") as srv:
            ext4.fill(leave=0)
            r = httpx.put(srv.ckpt_url("ck") + "/rules", json=RULES, timeout=30)
            assert r.status_code == 507, r.text
            assert _no_server_path(r, ext4.path, cache)["error"] == "NoSpaceError"
            assert srv.alive() and "Traceback" not in srv.log(), srv.log()
    finally:
        ext4.unfill()
        shutil.rmtree(cache, ignore_errors=True)
        ext4.clean()


# --- a cold sendfile whose client left ------------------------------------------------------------

@pytest.mark.pure
def test_a_cancelled_cold_sendfile_logs_no_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream cancelled (its client gone) while a sendfile of uncached bytes runs in a thread: the
    thread's BrokenPipeError must not reach asyncio's 'Future exception was never retrieved' log."""
    import asyncio
    import gc
    import socket
    import threading

    from reshard.service.transport import zerocopy

    data = tmp_path / "blob"
    data.write_bytes(os.urandom(1 << 20))
    started, release = threading.Event(), threading.Event()
    real = zerocopy._sendfile_closing

    def slow(sock: int, fd: int, offset: int, count: int) -> int:
        started.set()
        release.wait(10)
        return real(sock, fd, offset, count)  # the peer is gone by now: BrokenPipeError

    monkeypatch.setattr(zerocopy, "cached", lambda fd, offset: False)  # as if the page cache were cold
    monkeypatch.setattr(zerocopy, "_sendfile_closing", slow)
    logged: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: logged.append(ctx))
        a, b = socket.socketpair()
        a.setblocking(False)
        fd = os.open(data, os.O_RDONLY)
        task = asyncio.ensure_future(zerocopy.send_range(a.fileno(), fd, 0, 1 << 20))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        b.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.sleep(0.5)  # the thread's sendfile fails and its future completes
        a.close()
        os.close(fd)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not [c for c in logged if "never retrieved" in str(c.get("message", ""))], logged

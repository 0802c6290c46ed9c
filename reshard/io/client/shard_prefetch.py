"""A rank's shard fetched from the service while its process is still starting (`reshard launch --prefetch URL`).

Over a real link a shard takes seconds to arrive (537 MB at 1 Gbit/s: 4.3 s), about as long as the
imports of a TP worker. So the launcher starts the transfers first: before it imports torch and
transformers (only the standard library and `reshard.io` are loaded then, so the fork is cheap and
no thread exists), it forks one fetcher per local rank. A fetcher pulls its rank's shard (`ShardBody`:
retries, resume) into an anonymous shared-memory file (`memfd_create`), hashes it as it lands (in a
thread of its own), checks the sha256 against the server's digest, seals the file (no shrink, no
growth: no SIGBUS possible; the fetcher, the one writer, exits) and reports one JSON line on a pipe.
Fetchers run at the lowest CPU priority (`NICE`): the imports run on one core, and the transfer takes
what they leave.

The rank that forks later inherits its memfd and the pipe's read end, named in `RESHARD_PREFETCH`.
When it calls `fill_model(model, URL)` (or the trainer builds) for that URL, rank and layout, the fill
waits for the report and reads the bytes from the memfd as from a local rank file: parameters become
views of a private mapping of it (`reshard.fill.mapped_params`), nothing copied, nothing hashed twice. Any
other source, rank or layout, or a failed fetch (the report names the error), is pulled as usual.
The memory is the memfd's (shared memory: RssShmem of the rank once touched), freed when the rank's
tensors and descriptors are gone. A fetcher dies with its launcher (PR_SET_PDEATHSIG, from the fork on:
a launcher stopped during its imports leaves none running), and a rank waits for its fetch at most
`RESHARD_PREFETCH_TIMEOUT` seconds, then stops it and pulls the shard itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import select
import signal
from pathlib import Path
from typing import Any

from reshard.io.client.body import FileBody
from reshard.io.client.wire import checkpoint_url, layout_params
from reshard.io.owners import die_with
from reshard.layout.mesh import Layout
from reshard.settings import env_name, library_settings

ENV = env_name("prefetch")
log = logging.getLogger("reshard.io")
PIECE = 16 << 20
# a fetcher's CPU priority: the lowest, so that it takes the cores the launcher's imports (one thread)
# leave idle and never slows them. At normal priority, on 2 cores at tp=2 over loopback, the fetch
# slowed the imports by 0.8 s and the ranks were ready later than without a prefetch
NICE = 19
# no shrinking (no SIGBUS), no growth, no further seals; the fetcher's own writable mapping ends with it
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def start(url: str, rank: int, layout: int | Layout) -> dict[str, Any]:
    """Fork a fetcher of `rank`'s shard of `layout` (call before any thread exists); what the rank
    needs to find it: `RESHARD_PREFETCH` is `json.dumps` of this."""
    fd = os.memfd_create(f"reshard-rank-{rank}", os.MFD_ALLOW_SEALING)
    status_r, status_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        die_with(parent, signal.SIGKILL)  # a launcher that dies (even during its imports) takes its fetchers
        os.close(status_r)
        _fetch(url, rank, layout, fd, status_w)  # never returns
    os.close(status_w)
    return {"url": checkpoint_url(url), "rank": rank, "layout": layout_params(layout), "fd": fd, "status": status_r,
            "pid": pid}


def _fetch(url: str, rank: int, layout: int | Layout, fd: int, status: int) -> None:
    """In the fetcher: the shard into the memfd, verified and sealed; one JSON line on `status`; exit."""
    from reshard.io.client.body import ShardBody
    from reshard.io.hashing import BackgroundHash

    code = 0
    with contextlib.suppress(OSError):
        os.nice(NICE)  # before its hash thread starts, which inherits it
    try:
        body = ShardBody(url, rank, layout)
        try:
            os.ftruncate(fd, body.size)
            view = memoryview(mmap.mmap(fd, body.size))  # received in place; unmapped when the fetcher exits
            with BackgroundHash(hashlib.sha256(), backlog=None) as sha:
                for at in range(0, body.size, PIECE):
                    body.readinto(view[at : at + PIECE])
                    sha.update(view[at : at + PIECE])
                got = sha.hexdigest()
            want = body.expected_sha256()
        finally:
            body.close()
        if got != want:
            raise ValueError(f"sha256 of the {body.size} bytes received is {got}, the server says {want}")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        report: dict[str, Any] = {"size": body.size, "sha256": got, "name": body.name}
    except BaseException as e:  # noqa: BLE001  the rank pulls again, and says what is wrong then
        report, code = {"error": f"{type(e).__name__}: {e}"}, 1
    with contextlib.suppress(OSError):
        os.write(status, (json.dumps(report) + "\n").encode())
    os._exit(code)


def take(url: str, rank: int, layout: int | Layout) -> FileBody | None:
    """The prefetched shard of `rank` of `layout` from `url` as a body (waits until it is complete and
    verified), or None: none was prefetched for these, or the fetch failed (pull it as usual)."""
    spec = library_settings().prefetch
    if not spec:
        return None
    d = json.loads(spec)
    try:
        if (d["url"], d["rank"], d["layout"]) != (checkpoint_url(url), rank, layout_params(layout)):
            return None
    except Exception:  # noqa: BLE001  not a checkpoint URL: not ours to answer
        return None
    del os.environ[ENV]  # taken once: a second fill pulls as usual
    with os.fdopen(d["status"], "rb") as f:
        ready, _, _ = select.select([f], [], [], library_settings().prefetch_timeout)
        line = f.read() if ready else b""
    if not ready:  # a fetch that stalled: stop it, and pull as usual (with the client's own deadlines)
        with contextlib.suppress(OSError):
            os.kill(d["pid"], signal.SIGKILL)
        log.warning("the prefetch of rank %d did not finish within %s s (RESHARD_PREFETCH_TIMEOUT): stopped it; "
                    "pulling the shard now", rank, library_settings().prefetch_timeout)
    report = json.loads(line or b"{}")
    try:
        if "sha256" not in report:
            return None
        body = FileBody(Path(f"/proc/self/fd/{d['fd']}"))
    finally:
        os.close(d["fd"])  # the body has its own descriptor
    body.name, body.verified_as = f"{report['name']} (prefetched)", "sha256"
    return body


__all__ = ["ENV", "start", "take"]

"""`reshard launch --prefetch`'s fetchers against a server that accepts and never answers (issue 38,
finding 8): a fetcher dies with the process that forked it (the launcher killed during its imports
leaves none running), and a rank that waits for its fetch gives up after `RESHARD_PREFETCH_TIMEOUT`,
stops the fetcher and pulls for itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hard import wait_for

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP listener on 127.0.0.1 that takes connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1/checkpoints/m"
    sock.close()


LAUNCHER = """
import json, sys, time
from reshard.io.client import shard_prefetch
d = shard_prefetch.start(sys.argv[1], 0, 2)
print(json.dumps({{"pid": d["pid"]}}), flush=True)
{then}
"""


def _run(url: str, then: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", LAUNCHER.format(then=then), url], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_a_fetcher_dies_with_its_launcher(silent_server: str) -> None:
    proc = _run(silent_server, "time.sleep(60)")
    fetcher = json.loads(proc.stdout.readline())["pid"]
    assert os.path.exists(f"/proc/{fetcher}")  # stalled on the silent server
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert wait_for(lambda: not os.path.exists(f"/proc/{fetcher}") or _zombie(fetcher), timeout=20)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def test_a_stalled_prefetch_times_out_and_the_rank_pulls_itself(silent_server: str) -> None:
    then = """
import os
os.environ["RESHARD_PREFETCH"] = json.dumps(d)
t0 = time.monotonic()
body = shard_prefetch.take(sys.argv[1], 0, 2)
print(json.dumps({"body": body is not None, "waited": time.monotonic() - t0}), flush=True)
"""
    proc = _run(silent_server, then, RESHARD_PREFETCH_TIMEOUT="1")
    fetcher = json.loads(proc.stdout.readline())["pid"]
    out = json.loads(proc.stdout.readline())
    assert out["body"] is False and 0.9 < out["waited"] < 20, out
    assert wait_for(lambda: not os.path.exists(f"/proc/{fetcher}") or _zombie(fetcher), timeout=20)
    proc.wait(timeout=30)
    assert "did not finish within 1.0 s (RESHARD_PREFETCH_TIMEOUT): stopped it" in proc.stderr.read()

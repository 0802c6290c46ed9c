"""Helpers for tests against a real `reshard serve`: small checkpoints, a live server, a flaky proxy.

    from tests.support.live import live_server, make_ckpt

    root = tmp_path / "root"
    make_ckpt(root / "tiny")                             # llama-like, float32, ~0.4 MB
    with live_server(root, token="t", chunk_size=1 << 20) as srv:
        srv.url                                          # http://127.0.0.1:PORT
        srv.ckpt_url("tiny")                             # .../v1/checkpoints/tiny
        srv.rss(), srv.peak_rss(), srv.fds()             # server memory (bytes), fds: all its workers

`live_server` runs `python -m reshard.cli serve` in a subprocess on a free port (settings other than
root/host/port/token/out go through `RESHARD_*` environment variables), waits for /healthz and, with
`--workers N`, until every worker accepts (`accepting`), and terminates the server afterwards; its log
is at `srv.log_path`. `CuttingProxy` breaks connections after N bytes, for resume tests.
tests/conftest.py turns these into fixtures.
"""


from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from reshard.testing.local_servers import free_port
from reshard.testing.synth import llama_config, make_checkpoint

REPO = Path(__file__).resolve().parents[2]


def make_ckpt(path: Path, *, model_type: str = "llama", dtype: torch.dtype = torch.float32, num_files: int = 1,
              seed: int = 0, **config: Any) -> Path:
    """A small HF checkpoint directory (config.json + safetensors) with random weights."""
    return make_checkpoint(path, llama_config(model_type=model_type, **config), dtype=dtype,
                           num_files=num_files, seed=seed)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (a `--workers N` server: the supervisor and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_status_kib(pid: int, field: str) -> int:
    """A /proc status field summed over the process tree (processes that just ended count 0)."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError, KeyError):
            total += _status_kib(p, field)
    return total


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    token: str | None = None

    def ckpt_url(self, name: str) -> str:
        return f"{self.url}/v1/checkpoints/{name}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def rss(self) -> int:
        """Resident memory of the server, summed over its worker processes."""
        return tree_status_kib(self.proc.pid, "VmRSS") * 1024

    def peak_rss(self) -> int:
        """Peak resident memory, summed over its worker processes (an upper bound of the tree's peak)."""
        return tree_status_kib(self.proc.pid, "VmHWM") * 1024

    def fds(self) -> int:
        """Open file descriptors of the server and its workers."""
        return sum(len(os.listdir(f"/proc/{p}/fd")) for p in process_tree(self.proc.pid) if os.path.isdir(f"/proc/{p}/fd"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None


@contextlib.contextmanager
def live_server(root: Path, *, token: str | None = None, out: Path | None = None, log_dir: Path | None = None,
                startup_timeout: float = 60.0, workers: int = 1, command: Sequence[str] | None = None,
                environ: dict[str, str] | None = None, **settings: Any) -> Iterator[LiveServer]:
    """`reshard serve --root ROOT --workers N` on 127.0.0.1:free port until the block ends (one worker
    unless asked: the hardening tests use two). `command` runs another `reshard` (an installed one, in
    `environ`) instead of this checkout's."""
    # the session's verified-records directory (tests/conftest.py) goes along: write jobs record their files
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if not k.startswith("RESHARD_") or k == "RESHARD_VERIFIED_DIR"}
    env.update({f"RESHARD_{k.upper()}": str(v) for k, v in settings.items()})
    if command is None:
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    log_dir = log_dir or Path(root).parent
    if "://" in str(root):  # a root in a store: its cached blocks go with the logs, not to ~/.cache
        env.setdefault("RESHARD_STORE_CACHE_DIR", str(Path(log_dir) / f"store-cache-{os.getpid()}"))
    for _attempt in range(3):
        port = free_port()
        cmd = [*(command or (sys.executable, "-m", "reshard.cli")), "serve", "--root", str(root), "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", "--no-access-log", "--workers", str(workers)]
        if token:
            cmd += ["--token", token]
        if out:
            cmd += ["--out", str(out)]
        log_path = log_dir / f"server-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        srv = LiveServer(f"http://127.0.0.1:{port}", proc, log_path, token)
        if _wait_healthy(srv, startup_timeout, workers):
            break
        _stop(proc)
        if "address already in use" not in srv.log() and " is in use " not in srv.log():  # uvicorn's, or serve's own
            raise RuntimeError(f"reshard serve did not start:\n{srv.log()}")
    else:
        raise RuntimeError("reshard serve: no free port after 3 tries")
    try:
        yield srv
    finally:
        _stop(proc)


def _wait_healthy(srv: LiveServer, timeout: float, workers: int = 1) -> bool:
    """/healthz answers, and then every one of `workers` workers accepts connections."""
    deadline = time.monotonic() + timeout
    while srv.alive() and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(srv.url + "/healthz", timeout=1.0).status_code == 200:
                break
        time.sleep(0.1)
    else:
        return False
    while srv.alive() and time.monotonic() < deadline:
        if workers == 1 or len(accepting(srv)) >= workers:
            return True
        time.sleep(0.05)
    return False


def accepting(srv: LiveServer) -> set[int]:
    """The server's processes whose event loop watches its listening socket: the workers that accept
    connections (one that is still importing or starting its app does not; /healthz answered by one
    worker says nothing of the others). An epoll's /proc fdinfo names each watched file's inode."""
    port = f"{int(srv.url.rsplit(':', 1)[1]):04X}"
    listening = [f[9] for f in (ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:])
                 if f[1].endswith(":" + port) and f[3] == "0A"]
    if not listening:
        return set()
    watch = f" ino:{int(listening[0]):x} "
    out = set()
    for pid in process_tree(srv.proc.pid):
        with contextlib.suppress(OSError):
            if any(watch in info.read_text() for info in Path(f"/proc/{pid}/fdinfo").iterdir()):
                out.add(pid)
    return out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# --- shared checkpoints ---------------------------------------------------------------------------

# name -> (make_ckpt kwargs, tp values it plans for)
SMALL_CKPTS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    # column / row / vocab_embed padded (vocab 250 is not a multiple of 4) / replicate norms, float32
    "llama": ({"vocab_size": 250, "num_key_value_heads": 4}, (1, 2, 4)),
    # bfloat16, q/k/v biases, three files + index.json, GQA (2 kv heads)
    "qwen2": ({"model_type": "qwen2", "dtype": torch.bfloat16, "num_files": 3}, (1, 2)),
    # packed_column (fused qkv_proj and gate_up_proj)
    "phi3": ({"model_type": "phi3", "num_key_value_heads": 4}, (1, 2, 4)),
}
BIG = "big"  # ~56 MB float32: 28 MB column-split shards at tp=2


class LoopbackProxy:
    """A TCP relay on 127.0.0.1 to `upstream` (host, port); subclasses shape the response in `_relay`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client, self._on_connect()), daemon=True).start()

    def _on_connect(self) -> Any:
        """Per-connection state handed to `_relay` (decided in accept order)."""
        return None

    def _connect_upstream(self) -> socket.socket:
        return socket.create_connection(self.upstream)

    def _request_seen(self, data: bytes) -> None:
        pass

    def _relay(self, up: socket.socket, client: socket.socket, state: Any) -> None:
        raise NotImplementedError

    def _serve(self, client: socket.socket, state: Any) -> None:
        up = self._connect_upstream()

        def upstream_pump() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(65536):
                    self._request_seen(data)
                    up.sendall(data)
            with contextlib.suppress(OSError):
                up.shutdown(socket.SHUT_WR)

        threading.Thread(target=upstream_pump, daemon=True).start()
        with contextlib.suppress(OSError):
            self._relay(up, client, state)
        for s in (client, up):  # shutdown wakes the other thread's recv; close alone would not
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class CuttingProxy(LoopbackProxy):
    """A proxy that breaks its first `cuts` connections after relaying `cut_after` response bytes:
    a flaky network, for resume tests. Records every request head."""

    def __init__(self, upstream: tuple[str, int], *, cut_after: int, cuts: int = 1) -> None:
        self.cut_after, self.cuts = cut_after, cuts
        self.requests: list[bytes] = []
        self.on_cut: Any = None  # called after each cut, before the client can reconnect
        super().__init__(upstream)

    def _on_connect(self) -> bool:
        cut = self.cuts > 0
        self.cuts -= 1
        return cut

    def _request_seen(self, data: bytes) -> None:
        if data[:4] in (b"GET ", b"HEAD", b"PUT ", b"POST"):
            self.requests.append(data.split(b"\r\n\r\n")[0])

    def _relay(self, up: socket.socket, client: socket.socket, cut: bool) -> None:
        sent = 0
        while data := up.recv(65536):
            if cut and sent + len(data) >= self.cut_after:
                client.sendall(data[: self.cut_after - sent])
                if self.on_cut is not None:
                    self.on_cut()  # before the client can notice the cut and reconnect
                return
            client.sendall(data)
            sent += len(data)


# --- reading a live server ---------------------------------------------------------------------------

def metric(srv: LiveServer, line_prefix: str) -> float:
    """The sum of the /metrics samples whose line starts with `line_prefix`."""
    text = httpx.get(srv.url + "/metrics", headers=srv.headers()).text
    values = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_prefix)]
    return sum(values)


def streams_settled(srv: LiveServer, timeout: float = 10.0) -> bool:
    """Waits until no shard body is being sent (a stream a client cut is counted only once the server sees the
    hang-up); whether that happened within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while metric(srv, "reshard_active_streams"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def raw_request(srv: LiveServer, target: str, *, read: int = 0) -> bytes:
    """A hand-written GET of `target`; the answer (stops after `read` bytes when given: a client hanging up)."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while chunk := s.recv(65536):
            got += chunk
            if read and len(got) >= read:
                break
        return got


def sendfile_bytes(ckpt: Path, tp: int, rank: int, lo: int, hi: int) -> int:
    """Bytes of [lo, hi) of the rank file in contiguous ranges of a source file at least DIRECT_MIN
    long (within [lo, hi)): what the server should hand to sendfile, from the plan's segments."""
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan
    from reshard.service.transport.pump import DIRECT_MIN

    src, manifest = open_source(ckpt)
    rp = make_plan(src, manifest, tp).ranks[rank]
    pos, total = len(rp.header), 0
    for t in rp.tensors:
        for seg in t.segments:
            part = min(hi, pos + seg.nbytes) - max(lo, pos)  # the piece's bytes inside [lo, hi)
            if getattr(seg, "contiguous", False) and seg.file is not None and part >= DIRECT_MIN:
                total += part
            pos += seg.nbytes
    return total


def run_job(url: str, name: str, tp: int, *, timeout: float = 60) -> dict[str, Any]:
    """POST a write job for checkpoint `name` at `tp` to the service at `url` and poll it until it ends
    (or `timeout` seconds pass); the job as last seen."""
    r = httpx.post(f"{url}/v1/checkpoints/{name}/jobs", json={"tp": tp}, timeout=30)
    assert r.status_code == 202, r.text
    job = r.json()
    deadline = time.monotonic() + timeout
    while job["state"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=30).json()
    return job

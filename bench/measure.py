"""Run a command as a subprocess: wall time and peak RssAnon summed over its process tree.

RssAnon (resident anonymous memory: heap, stacks, anonymous mmaps; not the page cache that file
reads and `mmap`ed files land in) is read from `/proc/PID/status` every ~20 ms for the root process
and every descendant found through `/proc/PID/task/*/children`. Processes that are not children of
the command (a server it talks to) can be sampled alongside with `watch`.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_RSS_ANON = re.compile(rb"^RssAnon:\s+(\d+)\s+kB", re.M)
SAMPLE_S = 0.02


def rss_anon(pid: int) -> int:
    """RssAnon of one process in bytes (0 if it is gone or is a zombie)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            m = _RSS_ANON.search(f.read())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children(p))
    return seen


def tree_rss_anon(pid: int) -> int:
    return sum(rss_anon(p) for p in tree(pid))


class Sampler:
    """Samples the summed RssAnon of some process trees in a thread; keeps the peak of each."""

    def __init__(self, roots: Mapping[str, int], interval: float = SAMPLE_S) -> None:
        self.roots = dict(roots)
        self.interval = interval
        self.peak = {k: 0 for k in self.roots}
        self.base = {k: tree_rss_anon(p) for k, p in self.roots.items()}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def add(self, name: str, pid: int) -> None:
        self.roots[name] = pid
        self.peak.setdefault(name, 0)
        self.base.setdefault(name, 0)

    def sample(self) -> None:
        for k, pid in list(self.roots.items()):
            self.peak[k] = max(self.peak[k], tree_rss_anon(pid))
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    """One timed run of one command."""

    name: str
    wall_s: float
    peak_rss_anon: int  # bytes, summed over the command's process tree
    returncode: int
    watched_peak: dict[str, int] = field(default_factory=dict)  # e.g. the server's peak during the run
    watched_base: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    stderr_tail: str = ""
    stdout: str = ""


def run_command(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    watch: Mapping[str, int] | None = None,
    timeout: float = 1800.0,
    stdout_path: str | Path | None = None,
) -> Result:
    """Run `argv`, timing from just before the spawn to its exit, sampling RssAnon throughout."""
    full_env = {**os.environ, **(env or {})}
    out = open(stdout_path, "wb") if stdout_path else subprocess.PIPE  # noqa: SIM115
    try:
        with Sampler(dict(watch or {})) as sampler:
            t0 = time.perf_counter()
            proc = subprocess.Popen(list(argv), env=full_env, cwd=cwd, stdout=out, stderr=subprocess.PIPE)
            sampler.add("__cmd__", proc.pid)
            stdout, err = _drain(proc, timeout)
            wall = time.perf_counter() - t0
    finally:
        if stdout_path:
            out.close()
    peak = sampler.peak.pop("__cmd__")
    sampler.base.pop("__cmd__", None)
    tail = err.decode(errors="replace")[-2000:]
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: `{' '.join(argv)}` exited {proc.returncode}:\n{tail}")
    return Result(name, wall, peak, proc.returncode, sampler.peak, sampler.base, sampler.samples, tail,
                  stdout.decode(errors="replace")[-4000:])


def _drain(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"command timed out after {timeout} s: {proc.args}") from None
    return out or b"", err or b""


def median(xs: Iterable[float]) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

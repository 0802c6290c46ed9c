"""Owners of temp files: which process writes one, and whether that process is gone.

An owner id (`this_process()`: `pid:start time`, so a reused pid is not mistaken for the process)
goes into a temp file's name as `owner_tag()` (`pid-start`). A process that is SIGKILLed cannot
remove what it was writing; whoever comes next (a replacement worker, a restart) removes every temp
file whose owner is gone (`owner_gone`). The service's uploads, the copies of gathered pieces and the
store cache's blocks are written this way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if gone or dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie (killed, not yet reaped) is gone too


def this_process() -> str:
    """An owner id for the calling process: `pid:start time`."""
    return f"{os.getpid()}:{start_time(os.getpid())}"


def is_alive(owner: str) -> bool:
    pid, _, started = owner.partition(":")
    return pid.isdigit() and start_time(int(pid)) == started


def owner_tag(owner: str | None = None) -> str:
    """`owner` (default: this process) as a file-name part: `pid-start`."""
    return (owner if owner is not None else this_process()).replace(":", "-")


def tag_owner(tag: str) -> str:
    """The owner id of an `owner_tag`."""
    return tag.replace("-", ":", 1)


TAG = r"\d+-\d+"  # an owner_tag, in a pattern of temp file names


def owner_gone(path: Path, tag: str | None, *, ownerless_age: float) -> bool:
    """Whether the temp file `path`, whose name carries its writer's `tag`, was left by a writer that is
    gone. A name without a tag (None: an older version's) counts as left once it was last written
    more than `ownerless_age` seconds ago."""
    if tag is not None:
        return not is_alive(tag_owner(tag))
    try:
        return time.time() - path.lstat().st_mtime > ownerless_age
    except FileNotFoundError:
        return False


def die_with(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process `sig` when `parent` (the process that forked it) dies (Linux's
    PR_SET_PDEATHSIG); exit now if it already has (it died before the call)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(128 + sig)

"""Rank files known to hash to their recorded sha256: by file identity, so an unchanged file is not hashed again.

A fill from a local rank file must know its bytes are the ones `reshard.json` vouches for. Hashing
537 MB takes about half a second of a core, on the critical path of every start-up. So the identity of
a file whose sha256 is known (device, inode, size, mtime and ctime in nanoseconds) is recorded:

- by every write into a directory (`reshard write`, `reshard.write_shards`, a service write job: the one
  write path, `reshard.io.sinks.write`), for each rank file it wrote (the sha256 is the writer's);
- by a fill that hashed a rank file and found the recorded sha256;
- by `reshard merge` of a directory whose rank files have recorded digests (`check_recorded`).

A later fill (`verify="auto"`, the default) whose file has the same identity and whose `reshard.json`
records the same sha256 trusts it without hashing. Anything that rewrites the file in place changes
its mtime or size, and its ctime in any case (`touch -d` restoring the mtime sets the ctime to now:
user space cannot set a ctime), so it is hashed again, and refused if its bytes do not match. What
identity cannot see: bytes changed under the file system (a failing disk, a write to the block
device) and a record forged by someone who can write this user's cache. `verify="always"` hashes
every time.

Records are small JSON files under `$RESHARD_VERIFIED_DIR`, else `$XDG_CACHE_HOME/reshard/verified/`
(default `~/.cache/...`), one per (device, inode), written atomically; a stale one (the inode reused by another file) never matches.
Where the directory cannot be written, nothing is recorded and files are hashed each time.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from reshard.cachedir import cache_dir as user_cache
from reshard.settings import library_settings

Identity = tuple[int, int, int, int, int]


def cache_dir() -> Path:
    return user_cache("verified", library_settings().verified_dir)


def identity(fd: int) -> Identity:
    """(device, inode, size, mtime_ns, ctime_ns) of the file open on `fd`."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _record_path(ident: Identity) -> Path:
    return cache_dir() / f"{ident[0]:x}-{ident[1]:x}.json"


def trusted(fd: int, sha256: str) -> bool:
    """Whether the file open on `fd` was verified to hash to `sha256` and has not changed since."""
    ident = identity(fd)
    try:
        rec = json.loads(_record_path(ident).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and rec.get("sha256") == sha256 and tuple(rec.get("identity", ())) == ident


def record(fd: int, sha256: str, *, path: str | os.PathLike[str] = "") -> bool:
    """Remember that the file open on `fd` hashes to `sha256` (as it is now); whether it was recorded."""
    ident = identity(fd)
    dest = _record_path(ident)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"identity": list(ident), "sha256": sha256, "path": str(path)}))
        os.replace(tmp, dest)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False


def record_written(out_dir: str | os.PathLike[str], files: dict[str, dict]) -> int:
    """After a write: record each rank file of `files` (`reshard.json`'s "files": name -> {"sha256", ...})
    in `out_dir`; how many were recorded."""
    done = 0
    for name, f in files.items():
        sha = f.get("sha256") if isinstance(f, dict) else None
        if not isinstance(sha, str):
            continue
        try:
            fd = os.open(Path(out_dir) / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_size == f.get("size", -1):
                done += record(fd, sha, path=Path(out_dir) / name)
        finally:
            os.close(fd)
    return done


__all__ = ["cache_dir", "identity", "record", "record_written", "trusted"]


"""The output side's file system: room for what is planned, and OS errors turned into one clear line.

    out = prepare_dir(path)                       # mkdir -p, or OutputPathError / ReadOnlyError ...
    check_space(out, planned_bytes)               # NoSpaceError "needs 27.3 MB in /mnt/out, 19.8 MB free"
    with output_errors(out, retry="run the same command again"):
        ...write...                               # an OSError (ENOSPC, EROFS, EIO...) -> its OutputError

Every writer of this package (`reshard write`, `merge`, the trainer's save, `pull`, the service's
uploads and jobs) goes through these, so each cause reads the same wherever it happens: the path,
the cause in words, and the fix. Files are published atomically (`atomic_file`: a temp file beside
the target, fsync, rename, fsync the directory), so nothing partial ever has a final name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from reshard.errors import (
    NoSpaceError,
    OutputError,
    OutputIOError,
    OutputPathError,
    OutputPermissionError,
    QuotaError,
    ReadOnlyError,
)

__all__ = ["EXCLUSIVE", "check_space", "create_exclusive", "free_bytes", "made_dir", "megabytes", "open_own",
           "output_error", "output_errors", "prepare_dir", "random_temp"]


def megabytes(n: float) -> str:
    """Bytes as decimal megabytes with one decimal, as `df -H` counts: 27300000 -> '27.3 MB'."""
    return f"{n / 1e6:.1f} MB"


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (what a file system question can be asked of)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path` (df's "Avail")."""
    st = os.statvfs(_existing(Path(path)))
    return st.f_bavail * st.f_frsize


def check_space(directory: str | os.PathLike[str], needed: int, *, fix: str = "free some space there or write elsewhere") -> None:
    """Before the first byte: `ReadOnlyError` when `directory`'s file system is mounted read-only,
    `NoSpaceError` when `needed` bytes do not fit in it (where it reports a size)."""
    st = os.statvfs(_existing(Path(directory)))
    if st.f_flag & os.ST_RDONLY:
        raise ReadOnlyError(f"{directory}: read-only file system; remount it read-write or write elsewhere")
    free = st.f_bavail * st.f_frsize
    if needed > free and st.f_blocks:  # no blocks at all: a file system that says nothing of its size (ramfs)
        raise NoSpaceError(f"needs {megabytes(needed)} in {directory}, {megabytes(free)} free; {fix}")


def _file_parent(path: Path) -> Path | None:
    """The first ancestor of `path` that exists and is not a directory (why ENOTDIR was raised)."""
    for p in reversed(Path(os.path.abspath(path)).parents):
        if p.exists() and not p.is_dir():
            return p
    return None


def output_error(e: OSError, path: str | os.PathLike[str], *, retry: str = "run it again") -> OutputError | None:
    """The typed error for an OSError raised while writing an output at `path`; None for other errnos."""
    named = Path(e.filename) if isinstance(e.filename, str) else None
    where = named if named is not None and not named.name.startswith(".") else Path(path)  # not a temp's name
    code = e.errno
    if code == errno.ENOSPC:
        return NoSpaceError(f"{where}: no space left on device ({megabytes(free_bytes(where))} free); "
                            f"free some space or write elsewhere, then {retry}")
    if code == errno.EDQUOT:
        return QuotaError(f"{where}: disk quota exceeded; free some of your files there or write elsewhere, then {retry}")
    if code == errno.EROFS:
        return ReadOnlyError(f"{where}: read-only file system; remount it read-write or write elsewhere, then {retry}")
    if code in (errno.EACCES, errno.EPERM):
        return OutputPermissionError(f"{where}: permission denied; write to a directory you may write to, "
                                     f"or fix its permissions, then {retry}")
    if code == errno.EEXIST:
        return OutputPathError(f"{where}: exists and is not a directory; give a directory (new or existing) "
                               "as the output, or move the file away")
    if code == errno.ENOTDIR:
        parent = _file_parent(where)
        named = f"{parent} is a file, not a directory" if parent is not None else "a parent is not a directory"
        return OutputPathError(f"{where}: {named}; give an output path whose parents are directories")
    if code == errno.EISDIR:
        return OutputPathError(f"{where}: is a directory where a file must go; move it away or write elsewhere")
    if code == errno.EIO:
        return OutputIOError(f"{where}: I/O error on the output device; check the disk (dmesg) "
                             f"and write elsewhere, then {retry}")
    return None


@contextlib.contextmanager
def output_errors(path: str | os.PathLike[str], *, retry: str = "run it again") -> Iterator[None]:
    """Turn an OSError of the output side raised inside the block into its `OutputError`."""
    try:
        yield
    except OSError as e:
        err = output_error(e, path, retry=retry)
        if err is None:
            raise
        raise err from e


def prepare_dir(path: str | os.PathLike[str], *, for_file: str | os.PathLike[str] | None = None) -> Path:
    """`mkdir -p path`, an output path that names a file or lies under one being an `OutputPathError`.
    `for_file`: the file that will be written in `path` (named in the error instead of `path`)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        if for_file is not None:
            raise OutputPathError(f"{for_file}: {out} is a file, not a directory; give an output path whose parents are directories")
        raise OutputPathError(f"{out}: exists and is not a directory; give a directory (new or existing) "
                              "as the output, or move the file away")
    with output_errors(for_file if for_file is not None else out):
        out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def made_dir(path: str | os.PathLike[str], *, for_file: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """`prepare_dir(path)` for the block; when the block fails (an error, an interrupt), the directories
    that `prepare_dir` created are removed again, deepest first, as long as they are empty: a failed
    write that published nothing leaves no trace. A directory something was put in stays."""
    new, p = [], Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        new.append(p)
        p = p.parent
    out = prepare_dir(path, for_file=for_file)
    try:
        yield out
    except BaseException:
        for d in new:  # deepest first
            try:
                os.rmdir(d)
            except OSError:  # not empty (or gone): it and its parents stay
                break
        raise


TMP_PREFIX = ".tmp-"
# how every temp file is created: a new file or nothing (O_EXCL), never through a symlink planted at its name
# (O_NOFOLLOW: an existing name fails, a link is not followed to overwrite its target), not inherited by children
EXCLUSIVE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_exclusive(path: str | os.PathLike[str], *, flags: int = os.O_WRONLY, mode: int = 0o666) -> int:
    """A new file at `path`, open (`flags` | `EXCLUSIVE`): `FileExistsError` when anything is there already,
    a symlink included."""
    return os.open(path, flags | EXCLUSIVE, mode)


def random_temp(path: Path, *, suffix: str = ".part", flags: int = os.O_WRONLY) -> tuple[Path, int]:
    """A new temp file beside `path`, `.NAME.RANDOM{suffix}`, created exclusively: (its path, its descriptor).
    Its name cannot be guessed ahead, so nothing can be planted there."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{suffix}")
        try:
            return tmp, create_exclusive(tmp, flags=flags)
        except FileExistsError:  # 2**-64 unless planted: another name
            continue


def open_own(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int | None:
    """`path` opened without following a symlink, if it is a regular file of this user with no other link
    (a file an earlier run of this user left: a partial download to resume); else None."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
        return fd
    os.close(fd)
    return None


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """Write `path` atomically: a temp file beside it (created exclusively), fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(create_exclusive(tmp), "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def temp_path(path: Path) -> Path:
    """A temp file beside `path` that this process writes before renaming (see `remove_stale_temps`): its pid,
    then a random part (nothing can be planted at the name ahead), then the file's name."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")


def copy_atomic(src: Path, dst: Path) -> None:
    """Copy the file `src` to `dst` atomically."""
    with atomic_file(dst) as f, open(src, "rb") as g:
        shutil.copyfileobj(g, f)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None


def start_writeback(fd: int, offset: int, n: int) -> None:
    """Have the kernel start writing bytes [offset, offset+n) of `fd` to its disk now, without waiting
    (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`; elsewhere nothing). Durability still comes from
    the fsync at the end, which then finds most pages written: the disk works while the writer copies,
    instead of after it (`cp -r && sync` leaves it all to the sync)."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = f
    if _sync_file_range:
        _sync_file_range(fd, offset, n, _SYNC_FILE_RANGE_WRITE)  # a hint: its errors surface at the fsync


def delete_oldest(files: list[tuple[float, int, str]], max_bytes: int) -> int:
    """Delete the least recently used of `files` ((mtime, size, path) each) until their sizes add up
    to at most `max_bytes` (a file already gone counts as deleted); the bytes left."""
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
        total -= size
    return total


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[bool]:
    """An exclusive `flock` on `path` (made if missing) for the block, released if the holder dies;
    yields False (and holds nothing) where the file cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: Path) -> None:
    """Remove temp files left by writers that no longer run (killed mid-write)."""
    for p in Path(directory).glob(f"{TMP_PREFIX}*"):
        pid = p.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def _alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (killed, not yet reaped by its parent) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no /proc: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_json_atomic(path: Path, obj: Any) -> None:
    with atomic_file(path) as f:
        f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

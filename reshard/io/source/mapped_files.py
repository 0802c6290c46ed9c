"""Local source files mapped into memory for strided gathers, each mapping guarded by a read lease.

A row-split rank needs a slice of every row. From a mapping, numpy copies just those bytes in one
vectorized copy, instead of reading the row blocks that cover them (tp times the bytes) and gathering
from there: for a tp=4 rank of the 1 GB checkpoint, 0.04 s instead of 0.20 s. But a mapped page that
a truncation removes kills the process with SIGBUS, so a file is mapped only while this process
holds a read lease on it (`fcntl(F_SETLEASE, F_RDLCK)`): whoever then opens the file for writing or
truncates it is held by the kernel until the lease is given back, and this process gets SIGIO. The
handler only wakes a keeper thread; the keeper marks each broken lease's mapping unusable and, once
no gather is inside it (a gather copies at most a few MiB), unmaps it and gives the lease back, and
the writer goes on. Later reads of that file use pread, which sees the change as any read does.
Where no lease can be had (not the file's owner and no CAP_LEASE, the file open for writing
somewhere, a file system without leases) the file is read with pread, as before.

A long-lived process opts in once with `enable()` from its main thread (`reshard serve`'s workers
do); mappings are kept across streams per (device, inode, size, mtime), at most `MAX_MAPPED` bytes
of address space, the least recently used unmapped first, and unmapped after `SWEEP` to `2 * SWEEP`
seconds unused or once their file is deleted (a file replaced by a rename frees its disk space only
when nothing maps it). Their pages are the page cache's: they
count as the process's shared (file) memory, not its anonymous memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import signal
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from reshard.plan.reads import runs_array

if TYPE_CHECKING:
    import numpy as np

MAX_MAPPED = 256 << 30  # bytes of address space mapped at once
SWEEP = 30.0  # seconds: a mapping unused this long (or of a deleted file) is unmapped


class _Mapping:
    def __init__(self, fd: int, key: tuple[int, int, int, int]) -> None:
        self.fd, self.key, self.size = fd, key, key[2]
        import numpy as np

        self.mm = mmap.mmap(fd, self.size, prot=mmap.PROT_READ)
        self.array: np.ndarray | None = np.frombuffer(self.mm, np.uint8)
        self.users, self.valid, self.used = 0, True, True

    def close(self) -> None:
        self.array = None
        self.mm.close()
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(self.fd)


def file_key(fd: int) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime_ns) of the file open on `fd`."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def leased_copy(fd: int, key: tuple[int, int, int, int]) -> int | None:
    """A descriptor of its own for the file open on `fd` (so that a lease lives as long as whoever
    holds it), holding a read lease, if the file still is `key` (`file_key`); None where it is not or
    no lease can be had (then read the file instead of mapping it)."""
    try:
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if file_key(own) != key:
            raise OSError("changed")
        fcntl.fcntl(own, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        return own
    except OSError:
        os.close(own)
        return None


class MappedFiles:
    """The process's leased mappings (one instance: `MAPS`)."""

    def __init__(self) -> None:
        self.enabled = False
        self._keeping = False  # the SIGIO handler and the keeper thread are installed (once per process)
        self._lock = threading.Lock()
        self._maps: OrderedDict[tuple[int, int, int, int], _Mapping] = OrderedDict()
        self._mapped = 0

    def enable(self) -> bool:
        """Start mapping (installs the SIGIO handler: main thread only); whether it is on."""
        if self.enabled or threading.current_thread() is not threading.main_thread():
            return self.enabled
        if self._keeping:
            self.enabled = True
            return True
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        previous = signal.getsignal(signal.SIGIO)

        def on_sigio(sig: int, frame: Any) -> None:  # no locks here: only a byte down the pipe
            with contextlib.suppress(BlockingIOError):
                os.write(wake_w, b"\0")
            if callable(previous):
                previous(sig, frame)

        signal.signal(signal.SIGIO, on_sigio)
        threading.Thread(target=self._keep, args=(wake_r,), name="reshard-leases", daemon=True).start()
        self.enabled = self._keeping = True
        return True

    @contextlib.contextmanager
    def enabled_while(self) -> Iterator[bool]:
        """Mapping on for the block (one command: `reshard write`), then as it was before (what the block
        mapped is unmapped if it was off)."""
        was = self.enabled
        on = self.enable()
        try:
            yield on
        finally:
            if not was:
                self.enabled = False
                self.clear()

    def gather(self, fd: int, ident: tuple[int, int, int, int], out: np.ndarray, offset: int, run: int,
               stride: int, count: int) -> bool:
        """Copy the `count` runs of `run` bytes `stride` apart from `offset` of the file open on `fd`
        (`ident`: its device, inode, size and mtime when opened) into `out` (`reshard.plan.reads.runs_array`);
        False if the file cannot be mapped now (read it instead)."""
        m = self._acquire(fd, ident) if self.enabled else None
        if m is None:
            return False
        try:
            if offset + (count - 1) * stride + run > m.size:
                return False  # not in the file as mapped: let pread report it
            assert m.array is not None
            out[...] = runs_array(m.array, offset, run, stride, count)
            return True
        finally:
            self._release(m)

    def _acquire(self, fd: int, key: tuple[int, int, int, int]) -> _Mapping | None:
        with self._lock:
            m = self._maps.get(key)
            if m is None:
                m = self._map(fd, key)
            elif m.valid:
                self._maps.move_to_end(key)
                m.used = True
            if m is None or not m.valid:
                return None
            m.users += 1
            return m

    def _map(self, fd: int, key: tuple[int, int, int, int]) -> _Mapping | None:
        """A leased mapping of the file on `fd` (its own descriptor, so the lease is this cache's), or None."""
        size = key[2]
        if not size or size > MAX_MAPPED:
            return None
        own = leased_copy(fd, key)
        if own is None:
            return None
        try:
            m = _Mapping(own, key)
        except (OSError, ValueError):
            os.close(own)
            return None
        self._evict(size)
        self._maps[key] = m
        self._mapped += size
        return m

    def _evict(self, incoming: int) -> None:
        for key in [k for k, m in self._maps.items() if m.users == 0]:
            if self._mapped + incoming <= MAX_MAPPED:
                break
            self._drop(key)

    def _drop(self, key: tuple[int, int, int, int]) -> None:
        m = self._maps.pop(key)
        self._mapped -= m.size
        m.close()

    def _release(self, m: _Mapping) -> None:
        with self._lock:
            m.users -= 1
            if not m.valid and m.users == 0:
                self._drop(m.key)

    def _keep(self, wake: int) -> None:
        """The keeper: on every SIGIO, give back each broken lease (once its mapping is unused); every
        `SWEEP` seconds, unmap what was not used since the last sweep or was deleted (replaced by a
        rename: its disk space is freed only when nothing maps it)."""
        while True:
            woken = select.select([wake], [], [], SWEEP)[0]
            if woken:
                os.read(wake, 4096)
            with self._lock:
                for m in list(self._maps.values()):
                    try:
                        broken = fcntl.fcntl(m.fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
                        stale = not woken and (not m.used or os.fstat(m.fd).st_nlink == 0)
                    except OSError:
                        broken = True
                    if broken:
                        m.valid = False
                    if m.users == 0 and (broken or stale):
                        self._drop(m.key)
                    m.used = False

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the files mapped now."""
        return self._mapped

    def clear(self) -> None:
        """Unmap everything not in use (tests; a process that wants its address space back)."""
        with self._lock:
            for key in [k for k, m in self._maps.items() if m.users == 0]:
                self._drop(key)


MAPS = MappedFiles()

"""A bounded disk cache of store objects' bytes, shared by the processes of one node: each block of each
object version is fetched from the store at most once while it stays in the cache.

`reshard serve --root s3://...` (or `http(s)://`) turns it on (`enable`); its streams then read their
source ranges through it (`reshard.io.source.readers.RemoteReader`), so every rank and every layout served on
the node comes from one fetch of each block, however many pulls ask for it and whichever worker
process answers them.

- Blocks: `BLOCK` bytes of one object at block-aligned offsets (the last one shorter), one file each,
  under DIR/<hash of the object's URL and version>/<block number>. The version is the object's ETag
  (else its version id or Last-Modified: `reshard.io.source.stores.object_version`), and every fetch is
  conditional on it, so a replaced object is a new key and its old blocks are never served for it.
- One fetch per block: the fetch holds an exclusive `flock` on the block's lock file, and pulls that
  want the same block (any thread, any worker) wait on that lock, then read the file the fetch wrote.
  A block is written under a temporary name and renamed whole: a partial block is never read. The
  temporary name carries its writer (`.K.PID-START.THREAD`, `reshard.io.owners.owner_tag`): one that a
  killed process left is removed at the next sweep, and a worker's start sweeps (`enable`).
- Sealed: each block file ends with the sha256 of its bytes (`reshard.io.sealed`), checked once per
  version of the file per process before it is read; a block changed in place, or replaced by a
  symlink, is deleted and fetched again, never served.
- Bounded: at most `max_bytes` of blocks; past it the least recently used are deleted (a reader that
  has a block open keeps reading it). A block that cannot be written (full disk, read-only) is still
  used from memory by the pull that fetched it, and the failure is logged once: the cache never fails
  a pull.
- Read like local files: a stream holds the blocks it reads open (`open_block`, `reshard.io.source.cached_object`),
  sends their contiguous ranges with `sendfile` and gathers strided runs from their mappings, as it
  would from a local source file.
- Counted: `fetched` (bytes fetched from the store for blocks) and `hits` (bytes read from blocks in
  the cache, also reported to `on_hit`: the service's Prometheus counter; every byte fetched from a
  store is counted by `reshard.io.source.stores.count_fetched`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from reshard.errors import SourceChangedError
from reshard.io.outfs import delete_oldest, flocked
from reshard.io.owners import TAG, owner_gone, owner_tag
from reshard.io.pread import pread_full
from reshard.io.sealed import Sealer, open_sealed, touch_used

log = logging.getLogger("reshard.io")

Fetch = Callable[[int, int], Iterable[memoryview]]  # bytes [lo, hi) of the object, in pieces as they arrive
BLOCK = 8 << 20  # bytes per cached block: one GET each
_SWEEP_EVERY = 64 << 20  # bytes written between two looks at the cache's size
_STALE = 3600.0  # seconds: a temporary block file without its writer's tag (an older version's) this old is left
_TEMP = re.compile(rf"^\.\d+\.(?:({TAG})|\d+)\.\d+$")  # .K.PID-START.THREAD (.K.PID.THREAD: an older version's)


class Block:
    """One block as a pull holds it: its open file (`fd`), or, where it could not be kept, its bytes in
    memory (`fd` None); `hit`: it was in the cache already. Block files are written once and renamed into
    place, never changed in place (only deleted, which leaves an open one readable), so a mapping of one
    cannot lose its pages."""

    def __init__(self, fd: int | None, size: int, *, data: memoryview | None = None, hit: bool = False) -> None:
        self.fd, self.size, self.hit = fd, size, hit
        self._data = data
        self.pins = 0  # ranges of its file handed to a sink that has not sent them yet (`reshard.io.source.cached_object`)

    def view(self) -> memoryview:
        """The block's bytes: a read-only mapping of its file (made on first use), or the bytes fetched."""
        if self._data is None:
            assert self.fd is not None
            self._data = memoryview(mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ))
        return self._data

    def read_into(self, dst: memoryview, at: int) -> None:
        """dst <- bytes [at, at + len(dst)) of the block."""
        if self.fd is None or self._data is not None:
            dst[:] = self.view()[at : at + len(dst)]
            return
        got = pread_full(self.fd, dst, at)
        if got < len(dst):
            raise OSError(f"block file ended at byte {at + got} of {self.size}")

    def close(self) -> None:
        """Close its file (a mapping goes with the last view of it)."""
        fd, self.fd, self._data = self.fd, None, None
        if fd is not None:
            os.close(fd)


def _opened(path: Path, size: int, *, hit: bool = True) -> Block | None:
    """The block file at `path`, open, if it is there whole and sealed (`reshard.io.sealed`: a block whose
    bytes changed since it was stored, or a symlink, is deleted and reported missing, so it is fetched
    again); recently used from now on (evicted last)."""
    fd = open_sealed(path, size)
    if fd is None:
        return None
    touch_used(fd)  # its atime is the eviction's clock (the mtime dates its bytes)
    return Block(fd, size, hit=hit)


def _discard(f: Any, tmp: Path) -> None:
    """Close (if open) and remove a temporary block file."""
    with contextlib.suppress(OSError):
        if f is not None:
            f.close()
    with contextlib.suppress(OSError):
        os.unlink(tmp)


class StoreCache:
    """The blocks in one directory (see the module docstring)."""

    def __init__(self, directory: Path, max_bytes: int, *, block: int = BLOCK) -> None:
        self.dir, self.max_bytes, self.block = Path(directory), max_bytes, block
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fetched = self.hits = 0
        self.on_hit: Callable[[int], None] | None = None
        self._lock = threading.Lock()
        self._since_sweep = 0
        self._estimate = 0  # bytes of blocks: the last sweep's count plus what this process stored since
        self._warned = False

    def read(self, fetch: Fetch, url: str, version: str, size: int, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the object `url` at `version` (`size` bytes), from cached blocks, each
        missing block fetched once with `fetch(lo, hi)` (a conditional GET of bytes [lo, hi), in pieces)."""
        out = memoryview(bytearray(end - start))
        for k in range(start // self.block, (end - 1) // self.block + 1):
            lo = k * self.block
            a, b = max(lo, start), min(lo + self.block, end)
            blk = self.open_block(fetch, url, version, size, k)
            try:
                blk.read_into(out[a - start : b - start], a - lo)
            finally:
                blk.close()
            if blk.hit:
                self.hit(b - a)
        return out

    def open_block(self, fetch: Fetch, url: str, version: str, size: int, k: int) -> Block:
        """Block k of the object `url` at `version` (`size` bytes), open: from the cache, else fetched
        once with `fetch(lo, hi)` under the block's lock and stored as it arrives (kept in memory where
        it cannot be stored)."""
        where = self.dir / hashlib.sha256(f"{url}\0{version}".encode()).hexdigest()[:32]
        path, lo = where / str(k), k * self.block
        n = min(lo + self.block, size) - lo
        blk = _opened(path, n)
        if blk is not None:
            return blk
        with self._locked(where, k):
            blk = _opened(path, n)  # another pull fetched it while this one waited
            if blk is not None:
                return blk
            blk = self._store(where, path, fetch(lo, lo + n), n, url)
            self._count("fetched", n)
        return blk

    def hit(self, n: int) -> None:
        """`n` bytes were read from blocks that were in the cache already."""
        self._count("hits", n)

    @contextlib.contextmanager
    def _locked(self, where: Path, k: int) -> Iterator[None]:
        """The block's fetch lock (an flock: released if its holder dies); without a usable directory,
        no lock (each pull fetches what it needs)."""
        with contextlib.suppress(OSError):
            where.mkdir(exist_ok=True)
        with flocked(where / f"{k}.lock") as held:
            if not held:
                self._failed(OSError(f"cannot lock blocks in {where}"))
            yield

    def _store(self, where: Path, path: Path, pieces: Iterable[memoryview], n: int, url: str) -> Block:
        """Write the `n` bytes of a block to its file as they arrive, under a temporary name renamed in
        whole; the block, open (its file, which a sweep may delete at once; else, where the disk refused
        it, its bytes in memory)."""
        tmp = where / f".{path.name}.{owner_tag()}.{threading.get_ident()}"
        got: list[memoryview] = []  # the pieces, for the in-memory block if the file fails
        failed: OSError | None = None
        sealer = Sealer()
        try:
            f = open(tmp, "wb")  # noqa: SIM115  (closed below, or where it fails)
        except OSError as e:
            f, failed = None, e
        try:
            for piece in pieces:
                got.append(piece)
                sealer.update(piece)
                if f is not None:
                    try:
                        f.write(piece)
                    except OSError as e:  # the rest still arrives: this pull uses it from memory
                        failed = e
                        _discard(f, tmp)
                        f = None
            if (total := sum(len(p) for p in got)) != n:
                raise SourceChangedError(f"{url}: block {path.name} came with {total} bytes, planned {n}; re-plan")
            if f is not None:
                f.write(sealer.trailer())
                f.close()
                f = None
                fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.rename(tmp, path)
                except OSError:
                    os.close(fd)
                    raise
        except OSError as e:
            failed = e
        finally:
            if f is not None or failed is not None:
                _discard(f, tmp)
        if failed is not None:
            self._failed(failed)
            return Block(None, n, data=memoryview(b"".join(got)))
        with self._lock:  # over the size as this process knows it, or time to count the other workers' blocks
            self._since_sweep += n
            self._estimate += n
            sweep = self._estimate > self.max_bytes or self._since_sweep >= _SWEEP_EVERY
            if sweep:
                self._since_sweep = 0
        if sweep:
            left = self.evict()
            with self._lock:
                self._estimate = left
        return Block(fd, n, hit=False)

    def evict(self) -> int:
        """Delete the temporary block files whose writer is gone, then the least recently used blocks
        until at most `max_bytes` remain (less the blocks being written); the bytes left."""
        blocks, writing, dead = [], 0, 0
        with flocked(self.dir / ".sweep.lock"):  # one sweep at a time, across the worker processes
            for sub in os.scandir(self.dir):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for e in os.scandir(sub.path):
                    with contextlib.suppress(OSError):
                        st = e.stat()
                        if e.name.isdigit():
                            blocks.append((st.st_atime, st.st_size, e.path))
                        elif e.name.startswith("."):
                            m = _TEMP.match(e.name)
                            if owner_gone(Path(e.path), m.group(1) if m else None, ownerless_age=_STALE):
                                os.unlink(e.path)
                                dead += 1
                            else:
                                writing += st.st_size
            left = delete_oldest(blocks, max(self.max_bytes - writing, 0))
            for _, _, path in blocks:  # the lock files of deleted blocks (a pull waiting on one may fetch it
                if not os.path.exists(path):  # once more: harmless)
                    with contextlib.suppress(OSError):
                        os.unlink(path + ".lock")
        if dead:
            log.warning("store cache %s: removed %d temporary block files that killed processes left", self.dir, dead)
        return left

    def _count(self, what: str, n: int) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + n)
        if what == "hits" and self.on_hit is not None:
            self.on_hit(n)

    def _failed(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("store cache %s: %s; blocks are fetched for each pull that needs them",
                        self.dir, e.strerror or e)


_CACHE: StoreCache | None = None


def enable(directory: Path, max_bytes: int, *, block: int = BLOCK) -> StoreCache | None:
    """Read every store object of this process through a cache in `directory` (None: `max_bytes` is 0,
    or the directory cannot be made; then nothing is cached, and a warning says why)."""
    global _CACHE
    _CACHE = None
    if max_bytes <= 0:
        return None
    try:
        _CACHE = StoreCache(directory, max_bytes, block=block)
        _CACHE._estimate = _CACHE.evict()  # a cache left larger than this size shrinks at once
    except OSError as e:
        log.warning("store cache %s cannot be used (%s): every pull fetches what it needs", directory,
                    e.strerror or e)
    return _CACHE


def disable() -> None:
    global _CACHE
    _CACHE = None


def current() -> StoreCache | None:
    """The cache this process reads store objects through, if any."""
    return _CACHE


__all__ = ["BLOCK", "Block", "StoreCache", "current", "disable", "enable"]

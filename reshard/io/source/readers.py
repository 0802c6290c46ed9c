"""How a `RankStream` reads its source files: `pread` on a local fd, or ranged GETs from a store.

`open_reader(path, key, fetch_ahead=)` gives a `LocalReader` (the fd also serves kernel copies) or a
`RemoteReader`. A remote object is read through the node's store cache where one is on (the
service's: `reshard.io.source.store_cache`), its blocks as local files (`reshard.io.source.cached_object`); else from
ranges its fetch-ahead (the stream's `Prefetcher`, `reshard.io.source.prefetch`, given to the reader when it
is built) fetched into memory, and direct GETs for anything it did not. Each GET names the planned
ETag: a replaced object fails the stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from reshard.errors import SourceChangedError
from reshard.io.pread import pread_full
from reshard.io.source import store_cache
from reshard.io.source.cached_object import CachedObject
from reshard.io.source.mapped_files import MAPS
from reshard.io.source.stores import is_url, store_for

if TYPE_CHECKING:
    import numpy as np

    from reshard.io.source.multirange import MultiRangeClient


class Reader(Protocol):
    """One source file of a stream; `fd` is set where the file is local (kernel copies)."""

    fd: int | None

    def pread(self, dst: memoryview, offset: int) -> None: ...

    def pread_runs(self, dst: memoryview, offset: int, run: int, stride: int, count: int) -> None:
        """The `count` runs of `run` bytes `stride` apart from `offset` into `dst` (the span that
        covers them); the bytes between runs are unspecified."""

    def gather(self, out: np.ndarray, offset: int, run: int, stride: int, count: int) -> bool:
        """The same runs straight into `out` (their `reshard.plan.reads.runs_array`) where the reader can (a leased
        mapping, `reshard.io.source.mapped_files`); False: use `pread_runs`."""

    def check(self) -> None:
        """Raise `SourceChangedError` if the file changed since it was planned."""

    def close(self) -> None: ...


class FetchAhead(Protocol):
    """A stream's fetch-ahead as its remote readers use it (`reshard.io.source.prefetch.Prefetcher`)."""

    def add(self, reader: RemoteReader) -> None:
        """Fetch ahead `reader`'s ranges of the stream too."""

    def copy(self, path: str, offset: int, dst: memoryview) -> bool:
        """Fill dst with bytes [offset, offset+len(dst)) of `path` fetched ahead; False if some were not."""


class LocalReader:
    def __init__(self, path: str, key: Sequence[Any]) -> None:
        self.path, self.key = path, tuple(key)
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise SourceChangedError(f"{e.filename}: cannot open source: {e.strerror}") from None
        try:
            st = os.fstat(self.fd)
            if (st.st_size, st.st_mtime_ns) != self.key:
                raise SourceChangedError(f"{path}: changed since it was planned (size {st.st_size}, planned {self.key[0]}); re-plan")
            self.ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # the file as opened
        except BaseException:
            self.close()
            raise

    def pread(self, dst: memoryview, offset: int) -> None:
        assert self.fd is not None
        got = pread_full(self.fd, dst, offset)
        if got < len(dst):
            raise SourceChangedError(f"{self.path}: ended at byte {offset + got}, before the planned data; re-plan")

    def pread_runs(self, dst: memoryview, offset: int, run: int, stride: int, count: int) -> None:
        self.pread(dst, offset)  # one read of the span: the page cache makes the gaps cheap

    def gather(self, out: np.ndarray, offset: int, run: int, stride: int, count: int) -> bool:
        assert self.fd is not None
        return MAPS.gather(self.fd, self.ident, out, offset, run, stride, count)

    def check(self) -> None:
        assert self.fd is not None
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self.key:
            raise SourceChangedError(f"{self.path}: changed while being read; re-plan and retry")

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class RemoteReader:
    """An object in a store: read from the node's block cache where one is on (`blocks`), else
    through its fetch-ahead where it has one (direct GETs for anything it did not fetch)."""

    fd = None

    def __init__(self, path: str, key: Sequence[Any], *, fetch_ahead: FetchAhead | None = None) -> None:
        from reshard.io.source.multirange import client_for

        self.path = path
        self.size, self.version = int(key[0]), str(key[1])
        self.store, self.key = store_for(path)
        cache = store_cache.current()
        self.blocks = CachedObject(cache, self._pieces, path, self.version, self.size) if cache is not None else None
        # fetched ahead in requests for several ranges where the server answers them (not into the block cache)
        self.multi: MultiRangeClient | None = (client_for(self.store, self.key, self.size, self.version)
                                               if fetch_ahead is not None and self.blocks is None else None)
        self.fetch_ahead = fetch_ahead
        if fetch_ahead is not None:
            fetch_ahead.add(self)

    def fetch_ranges(self, ranges: list[tuple[int, int]], dests: list[memoryview] | None = None) -> list[memoryview]:
        """Bytes [a, b) for each (a, b) of `ranges` (copied into `dests` where given, and then returned
        empty): in requests for several where the server answers them (`reshard.io.source.multirange`), else
        one GET each."""
        from reshard.io.source.multirange import Unanswered

        if self.multi is not None:
            try:
                if dests is None:
                    return self.multi.get(self.key, ranges, self.version)
                self.multi.get_into(self.key, ranges, self.version, dests)
                return []
            except Unanswered:  # too many ranges for this server (Starlette: 100, Apache: 200): ask fewer
                if len(ranges) > 2:
                    most = self.multi.most = min(self.multi.most, len(ranges) // 2)
                    out: list[memoryview] = []
                    for i in range(0, len(ranges), most):
                        out += self.fetch_ranges(ranges[i : i + most], None if dests is None else dests[i : i + most])
                    return out
                self.multi = None
        got = [self._get(a, b) for a, b in ranges]
        if dests is None:
            return got
        for dst, data in zip(dests, got):
            dst[:] = data
        return []

    def fetch(self, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the object: one conditional GET."""
        return self._get(start, end)

    def _get(self, start: int, end: int) -> memoryview:
        data, _ = self.store.get(self.key, start, end, version=self.version)
        if len(data) != end - start:
            raise SourceChangedError(f"{self.path}: {len(data)} bytes at {start}, planned {end - start}; re-plan")
        return data

    def _pieces(self, start: int, end: int) -> Iterator[memoryview]:
        """`_get`'s bytes as they arrive (for the store cache, which writes them to a block file)."""
        return self.store.get_chunks(self.key, start, end, version=self.version)

    def pread(self, dst: memoryview, offset: int) -> None:
        if self.blocks is not None:
            self.blocks.pread(dst, offset)
        elif self.fetch_ahead is None or not self.fetch_ahead.copy(self.path, offset, dst):
            dst[:] = self.fetch(offset, offset + len(dst))

    def pread_runs(self, dst: memoryview, offset: int, run: int, stride: int, count: int) -> None:
        if self.fetch_ahead is not None and self.blocks is None and self.fetch_ahead.copy(self.path, offset, dst):
            return  # the span was fetched ahead as one row block
        for i in range(count):
            self.pread(dst[i * stride : i * stride + run], offset + i * stride)

    def gather(self, out: np.ndarray, offset: int, run: int, stride: int, count: int) -> bool:
        if self.blocks is None:
            return False
        self.blocks.gather(out, offset, run, stride, count)
        return True

    def check(self) -> None:
        pass  # every GET is conditional on the planned ETag

    def close(self) -> None:
        if self.blocks is not None:
            self.blocks.close()


def open_reader(path: str, key: Sequence[Any], *, fetch_ahead: FetchAhead | None = None) -> Reader:
    """The reader of one source file: a store object (fetched ahead by `fetch_ahead` where given) or a
    local file."""
    return RemoteReader(path, key, fetch_ahead=fetch_ahead) if is_url(path) else LocalReader(path, key)

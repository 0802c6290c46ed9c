"""The chunk pool: a buffer is handed out again only once no view of it is left, and `release_all`
drops every buffer nobody holds (the ones a transport still holds stay until it lets go)."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.service.transport.buffers import ChunkPool

pytestmark = pytest.mark.pure


def _addr(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


def test_reused_only_when_released() -> None:
    pool = ChunkPool()
    a = pool.take(100, 1 << 16)
    b = pool.take(1 << 16, 1 << 16)
    assert len(a) == 100 and len(b) == 1 << 16 and _addr(a) != _addr(b) and len(pool) == 2
    held = a[10:20]  # a transport keeping a slice of a chunk keeps the chunk
    addr_a = _addr(a)
    del a
    c = pool.take(5, 1 << 16)
    assert _addr(c) != addr_a and len(pool) == 3
    del held
    d = pool.take(7, 1 << 16)
    assert _addr(d) == addr_a and len(pool) == 3  # no one holds it now: handed out again
    other = pool.take(10, 1 << 20)  # another chunk size never gets a smaller buffer
    assert len(other.obj) == 1 << 20
    pool.open()
    pool.open()
    del b, d
    pool.close()
    assert len(pool) == 4  # a stream is still open: nothing is dropped
    pool.close()
    assert len(pool) == 2  # the last stream closed: c and other are still held
    del c, other
    pool.release_all()
    assert len(pool) == 0

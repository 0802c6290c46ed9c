"""`pread_full`: one positional read that fills its buffer, the loop every file reader needs."""

from __future__ import annotations

import os


def pread_full(fd: int, dst: memoryview, offset: int) -> int:
    """Read `dst` from `fd` at `offset` (retrying short reads); the bytes read, fewer only where the
    file ends. The caller says what a short file means (a changed source, a truncated rank file)."""
    got = 0
    while got < len(dst):
        n = os.preadv(fd, [dst[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got

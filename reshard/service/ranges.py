"""Ranges and ETags of shard responses, pure: parse `Range`, compare `If-None-Match` / `If-Range`."""

from __future__ import annotations

import re

from reshard.service.errors import RangeNotSatisfiable

_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")


def shard_etag(plan_digest: str, rank: int) -> str:
    """Strong ETag: the plan digest covers source identity, manifest and tp; the rank is added."""
    return f'"{plan_digest[:40]}-r{rank}"'


def _position(digits: str) -> int:
    """A byte position from a Range header; absurdly long numbers (past any file, and past Python's
    4300-digit int parsing limit) become one huge value instead of an error."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 30 else 10**30


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single `bytes=a-b`, `a-` or `-n` range as a half-open [start, end); None for the whole body.

    Malformed or multi-range headers are ignored (RFC 9110 allows answering 200 with everything);
    a range starting at or past the end raises `RangeNotSatisfiable` (416).
    """
    if not header:
        return None
    m = _RANGE_RE.match(header)
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # suffix: the last n bytes
        n = _position(last)
        if n == 0:
            raise RangeNotSatisfiable(f"Range {header[:80]!r}: an empty suffix; the shard has {size} bytes", size=size)
        return (max(size - n, 0), size)
    start = _position(first)
    end = size if not last else min(_position(last) + 1, size)
    if last and _position(last) < start:
        return None  # invalid range: ignored
    if start >= size:
        raise RangeNotSatisfiable(f"Range {header[:80]!r} starts at or past the end of the {size}-byte shard", size=size)
    return (start, end)


def etag_matches(header: str | None, etag: str) -> bool:
    """`If-None-Match` / `If-Range` comparison (weak comparison for If-None-Match per RFC 9110)."""
    if not header:
        return False
    if header.strip() == "*":
        return True
    return any(tag.strip().removeprefix("W/") == etag for tag in header.split(","))

"""Ranges and ETags of shard responses, pure: parse `Range`, compare `If-None-Match` / `If-Range`.

Header lines, as RFC 9110 section 5.3 has them: a field that is not a list (`Range`, `If-Range`) may
appear once, so a request with two lines of one answers 400 (which of them was meant is unknowable;
answering either silently is the bug this avoids); a list field (`If-None-Match`) given on several lines
is their comma-joined values. Within one `Range` field, several ranges (`bytes=0-1,5-6`) or a malformed
one are ignored and the whole body answers 200, as RFC 9110 section 14.2 allows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from reshard.service.http_errors import BadRequest, RangeNotSatisfiable

_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")


def single_header(headers: Mapping[str, str], name: str) -> str | None:
    """The value of a header that may appear once (Starlette `Headers`); two lines of it: 400."""
    values = headers.getlist(name)  # type: ignore[attr-defined]
    if len(values) > 1:
        shown = ", ".join(repr(v[:40]) for v in values[:4])
        raise BadRequest(f"{len(values)} {name.title()} header lines ({shown}); send one (a `{name.title()}` field may not be "
                         "repeated, RFC 9110 section 5.3)")
    return values[0] if values else None


def list_header(headers: Mapping[str, str], name: str) -> str | None:
    """A list header's lines joined with commas (as RFC 9110 section 5.3 combines them); None if absent."""
    values = headers.getlist(name)  # type: ignore[attr-defined]
    return ", ".join(values) if values else None


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

"""Progress of long writes and pulls: tqdm's byte bar on a terminal, nothing in a pipe (unless forced)."""

from __future__ import annotations

import sys
from typing import Any, TextIO


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    """Call `update(n)` as bytes are done and `close()` at the end; `enabled` defaults to whether
    `stream` (stderr) is a terminal."""

    def __init__(self, total: int, label: str = "", *, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        stream = stream or sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        self._bar: Any = None
        if self.enabled:  # tqdm is imported only for a bar (its import is 0.02 s of a command's start-up)
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label or None, unit="B", unit_scale=True, unit_divisor=1024,
                             file=stream, mininterval=0.1, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def add_progress_flags(parser: Any) -> None:
    """--progress / --no-progress (default: a bar only on a terminal) for an argparse parser."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

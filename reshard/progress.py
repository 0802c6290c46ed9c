"""A one-line progress bar (bytes, rate, ETA) on a terminal; silent in a pipe."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    """Call `update(n)` as bytes are done and `close()` at the end."""

    def __init__(self, total: int, label: str = "", *, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.label, self.done = total, label, 0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        frac = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * 24)
        self.stream.write(
            f"\r{self.label} [{bar:<24}] {frac:6.1%} {human(self.done)}/{human(self.total)} "
            f"{human(rate)}/s ETA {eta:4.0f}s "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def add_progress_flags(parser: Any) -> None:
    """--progress / --no-progress (default: a bar only on a terminal) for an argparse parser."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

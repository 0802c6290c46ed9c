"""A download's deadline: how a client of the service tells a stalled transfer from a slow one.

    pace = Pace.from_settings()                      # RESHARD_CLIENT_STALL (30 s), RESHARD_CLIENT_MIN_RATE (4096 B/s)
    pace.restart()                                   # a request was sent: its window starts now
    if pace.got(len(piece)):                         # bytes arrived; a `Stalled` where the pace fell too low
        tries.progressed()                           # only progress at the pace resets the count of failures

Every body a client of the service reads (a shard through `ShardClient` or `ShardBody`, a small file of
`--meta`, a JSON answer) goes through one `Pace`, so that no server can hold a client forever: a
server that sends nothing is cut by the read timeout (at most `stall` seconds for a body), and one
that trickles (a byte every few seconds keeps any read timeout from firing, and a lying Content-Length
leaves the client waiting for bytes that never come) by the minimum rate: fewer than
`min_rate * stall` bytes within `stall` seconds of the last such amount is a `Stalled` failure. A
failure is retried and resumed as a broken connection is (`reshard.io.retry`), and since a trickle
never counts as progress, a stalling server exhausts the retries: a pull ends within about
`(retries + 1) * stall` seconds plus the waits between tries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from reshard.io.retry import Retryable
from reshard.settings import env_name, library_settings


class Stalled(Retryable):
    """A download fell under its minimum pace (retried like a broken connection)."""


@dataclass(frozen=True)
class PaceLimits:
    """At least `min_rate` bytes per second, measured over `stall` seconds."""

    stall: float = 30.0
    min_rate: int = 4096

    @classmethod
    def from_settings(cls) -> PaceLimits:
        s = library_settings()
        return cls(s.client_stall, s.client_min_rate)

    @property
    def quantum(self) -> int:
        """The bytes that must arrive within `stall` seconds (at least one)."""
        return max(1, int(self.min_rate * self.stall))

    def read_timeout(self, timeout: float) -> float:
        """The read timeout of a body's request: the client's `timeout`, at most `stall`."""
        return min(timeout, self.stall)


class Pace:
    """The pace of one download (see the module docstring); the loop that reads it names the download in
    its own error (`giving up after N retries at byte B: stalled: ...`)."""

    def __init__(self, limits: PaceLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self.count, self.since = 0, clock()

    @classmethod
    def from_settings(cls) -> Pace:
        return cls(PaceLimits.from_settings())

    def restart(self) -> None:
        """A new request: its window starts now, nothing counted yet."""
        self.count, self.since = 0, self.clock()

    def got(self, n: int) -> bool:
        """Count `n` bytes: True when a window's worth arrived (real progress); a `Stalled` when the
        window ran out before it did."""
        self.count += n
        now = self.clock()
        if self.count >= self.limits.quantum:
            self.count, self.since = 0, now
            return True
        if now - self.since > self.limits.stall:
            lim = self.limits
            raise Stalled(f"stalled: {self.count} bytes in {now - self.since:.1f} s, under the minimum "
                          f"of {lim.min_rate} bytes/s over {lim.stall:g} s ({env_name('client_min_rate')}, "
                          f"{env_name('client_stall')})")
        return False


__all__ = ["Pace", "PaceLimits", "Stalled"]

"""Tries again after a failure: how many times, how long to wait between tries, and when to give up.

    policy = Backoff(retries=5, first=0.25, cap=10.0)   # waits 0.25, 0.5, 1, 2, 4 s; the 6th failure gives up
    tries = Retries(policy, give_up=lambda e: ReshardError(f"{url}: giving up after 5 retries: {e}"))
    answer = tries.call(fetch, retry_on=(OSError, Retryable))   # fetch() until it returns or tries run out
    tries.failed(e)       # or count a failure by hand: waits, or raises give_up(e) from None
    tries.progressed()    # bytes arrived: the next failure counts from 1 again

Every loop that retries a request (`ShardClient`, `ShardBody`, `MultiRangeClient`) counts its
failures here, so the count, the waits and the error at the end follow one rule: failure n
(1-based) waits `min(first * 2 ** (n - 1), cap)` seconds; failure `retries + 1` raises. A loop
that resumes a transfer calls `progressed()` whenever bytes land, so only failures in a row count.
What is retryable (timeouts, broken connections, 5xx) is each caller's to say: it names the
exception types. obstore retries store requests itself; its `RetryConfig` is built from the same
`Backoff` (`reshard.io.source.stores`).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("reshard")


class Retryable(Exception):
    """A failure worth another try that is no exception of its own: the server answered 5xx, or the
    connection closed before the body ended (each loop raises it and names it in `retry_on`)."""


@dataclass(frozen=True)
class Backoff:
    """`retries` tries after the first failure, waiting `first` seconds, doubling each time, at most `cap`."""

    retries: int = 5
    first: float = 0.25
    cap: float = 10.0

    def delay(self, failure: int) -> float:
        """Seconds to wait after failure number `failure` (1-based) before the next try."""
        return min(self.first * 2 ** (failure - 1), self.cap)

    def obstore_config(self, *, retry_timeout: float) -> dict[str, Any]:
        """This policy as obstore's `RetryConfig` (obstore retries inside its own requests), giving up
        after `retry_timeout` seconds of retrying as well."""
        return {"max_retries": self.retries, "retry_timeout": datetime.timedelta(seconds=retry_timeout),
                "backoff": {"init_backoff": datetime.timedelta(seconds=self.first),
                            "max_backoff": datetime.timedelta(seconds=self.cap), "base": 2}}


class Retries:
    """The failures in a row of one job (a request, a transfer) under a `Backoff`.

    `give_up(e)` makes the error raised (from None) for the failure that is one too many; `on_retry`
    is told (error, failure number, seconds to wait) before each wait, to log or count it; `sleep` is
    how it waits (default `time.sleep`, looked up when the job starts; tests pass a recorder)."""

    def __init__(self, policy: Backoff, *, give_up: Callable[[BaseException], BaseException],
                 on_retry: Callable[[BaseException, int, float], None] | None = None,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.policy, self.give_up, self.on_retry = policy, give_up, on_retry
        self.sleep = sleep if sleep is not None else time.sleep
        self.failures = 0

    def failed(self, error: BaseException) -> None:
        """Count `error`; raise `give_up(error)` once there were more than `retries` in a row, else wait."""
        self.failures += 1
        if self.failures > self.policy.retries:
            raise self.give_up(error) from None
        wait = self.policy.delay(self.failures)
        if self.on_retry is not None:
            self.on_retry(error, self.failures, wait)
        self.sleep(wait)

    def progressed(self) -> None:
        """The job moved on (bytes arrived): the next failure is the first in a row again."""
        self.failures = 0

    def call(self, do: Callable[[], T], *, retry_on: tuple[type[BaseException], ...]) -> T:
        """`do()`'s result, tried again after each exception of the `retry_on` types (see `failed`);
        any other exception propagates at once. Failures already counted here count on."""
        while True:
            try:
                return do()
            except retry_on as e:
                self.failed(e)


def announce(where: str, retries: int) -> Callable[[BaseException, int, float], None]:
    """An `on_retry` that says each retry as it happens, on the `reshard` logger (a warning: the `reshard`
    commands show it on stderr, `--log-level error` hides it)."""

    def say(error: BaseException, failure: int, wait: float) -> None:
        what = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log.warning("%s: %s; retry %d of %d in %.2g s", where, what[:300], failure, retries, wait)

    return say


__all__ = ["Backoff", "Retries", "announce"]

"""`reshard.io.retry`: how many tries, the waits between them, what is retried and the error at the end;
and that each loop that retries (`ShardClient`, `ShardBody`, `MultiRangeClient`, obstore's config)
keeps its own counts and waits through it."""

from __future__ import annotations

import datetime
import time

import httpx
import pytest

from reshard.errors import NotFoundError, ReshardError, StoreUnavailableError
from reshard.io.client.body import ShardBody
from reshard.io.client.shard_client import ShardClient
from reshard.io.retry import Backoff, Retries
from reshard.io.source.multirange import MultiRangeClient
from reshard.io.source.readcost import Costs
from reshard.io.source.stores import store_backoff

pytestmark = pytest.mark.pure


class Flaky:
    """Fails `fails` times with `error`, then answers "ok"; counts its calls."""

    def __init__(self, fails: int, error: BaseException) -> None:
        self.fails, self.error, self.calls = fails, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.fails:
            raise self.error
        return "ok"


def _retries(policy: Backoff, waits: list[float], **kw: object) -> Retries:
    return Retries(policy, give_up=lambda e: ReshardError(f"gave up: {e}"), sleep=waits.append, **kw)  # type: ignore[arg-type]


def test_delays_double_up_to_the_cap() -> None:
    assert [Backoff(8, 0.25, 10.0).delay(n) for n in range(1, 9)] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [Backoff(5, 0.1, 5.0).delay(n) for n in range(1, 8)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0])


def test_succeeds_after_failures_with_their_waits() -> None:
    waits: list[float] = []
    do = Flaky(3, OSError("reset"))
    assert _retries(Backoff(5, 0.25, 10.0), waits).call(do, retry_on=(OSError,)) == "ok"
    assert do.calls == 4 and waits == [0.25, 0.5, 1.0]


def test_gives_up_after_retries_plus_one_tries() -> None:
    waits: list[float] = []
    do = Flaky(99, OSError("refused"))
    with pytest.raises(ReshardError, match=r"^gave up: refused$") as info:
        _retries(Backoff(3, 1.0, 2.5), waits).call(do, retry_on=(OSError,))
    assert do.calls == 4 and waits == [1.0, 2.0, 2.5]
    assert info.value.__cause__ is None and info.value.__suppress_context__  # raised from None


def test_no_retries_means_one_try() -> None:
    waits: list[float] = []
    do = Flaky(1, OSError("x"))
    with pytest.raises(ReshardError):
        _retries(Backoff(0, 1.0, 1.0), waits).call(do, retry_on=(OSError,))
    assert do.calls == 1 and waits == []


def test_other_errors_are_not_retried() -> None:
    waits: list[float] = []
    do = Flaky(1, ValueError("bad answer"))
    with pytest.raises(ValueError, match="bad answer"):
        _retries(Backoff(5, 0.25, 10.0), waits).call(do, retry_on=(OSError,))
    assert do.calls == 1 and waits == []


def test_progress_resets_the_count_and_the_hook_hears_each_retry() -> None:
    waits: list[float] = []
    heard: list[tuple[str, int, float]] = []
    tries = _retries(Backoff(2, 0.5, 10.0), waits, on_retry=lambda e, n, wait: heard.append((str(e), n, wait)))
    tries.failed(OSError("a"))
    tries.failed(OSError("b"))
    tries.progressed()  # bytes arrived: two more failures are allowed in a row
    tries.failed(OSError("c"))
    tries.failed(OSError("d"))
    with pytest.raises(ReshardError, match="gave up: e"):
        tries.failed(OSError("e"))
    assert waits == [0.5, 1.0, 0.5, 1.0]
    assert heard == [("a", 1, 0.5), ("b", 2, 1.0), ("c", 1, 0.5), ("d", 2, 1.0)]


def test_store_policy_is_obstores_config() -> None:
    """obstore gets the same retry config as before the helper: 100 ms doubling to 5 s."""
    assert store_backoff(7).obstore_config(retry_timeout=120.0) == {
        "max_retries": 7, "retry_timeout": datetime.timedelta(seconds=120),
        "backoff": {"init_backoff": datetime.timedelta(milliseconds=100), "max_backoff": datetime.timedelta(seconds=5),
                    "base": 2}}


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits of every retry loop in the test, instead of sleeping them."""
    got: list[float] = []
    monkeypatch.setattr(time, "sleep", got.append)
    return got


def test_shard_client_retries_5xx_then_names_the_error(waits: list[float]) -> None:
    answers = iter([503, 502, 404])
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(status := next(answers))
        return httpx.Response(status, json={"error": "NotFoundError", "detail": "no checkpoint x"})

    client = ShardClient("http://h/v1/checkpoints/x", backoff=0.25, transport=httpx.MockTransport(handler))
    with pytest.raises(NotFoundError, match="no checkpoint x"):
        client.info()
    assert seen == [503, 502, 404] and waits == [0.25, 0.5]


def test_shard_client_gives_up_after_retries(waits: list[float]) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("refused", request=request)

    client = ShardClient("http://h/v1/checkpoints/x", retries=6, backoff=0.5, transport=httpx.MockTransport(handler))
    with pytest.raises(ReshardError, match=r"^http://h/v1/checkpoints/x: giving up after 6 retries: refused$"):
        client.plan(2)
    assert len(calls) == 7 and waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]  # capped at 10 s


def test_shard_body_gives_up_after_retries(waits: list[float]) -> None:
    """Nothing listens on port 9: every connect is refused, retried with the client's waits."""
    with pytest.raises(ReshardError, match=r"rank 0/2: giving up after 3 retries at byte 0: .*refused"):
        ShardBody("http://127.0.0.1:9/v1/checkpoints/x", 0, 2, retries=3, backoff=0.125, timeout=2)
    assert waits == [0.125, 0.25, 0.5]


def test_multirange_retries_with_the_store_policy(waits: list[float]) -> None:
    calls: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers.get("range"))
        return httpx.Response(500)

    client = MultiRangeClient("http://store", Costs("http"))
    client._http = httpx.Client(transport=httpx.MockTransport(handler))  # noqa: SLF001
    with pytest.raises(StoreUnavailableError,
                       match=r"^http://store/m.safetensors: 2 ranges failed after 5 retries \(HTTP 500\)$"):
        client.get("m.safetensors", [(0, 4), (8, 12)], '"v1"')
    assert calls == ["bytes=0-3,8-11"] * 6 and waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6])

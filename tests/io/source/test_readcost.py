"""How a row-split tensor's rows are priced (`reshard.io.source.readcost`): the row block against each row's
slice, by the request, range and byte costs measured from the process's requests or set."""

from __future__ import annotations

import pytest

from reshard.io.source.readcost import Costs, Price
from reshard.settings import LibrarySettings

pytestmark = pytest.mark.pure

AUTO = LibrarySettings()
ROWS, RUN, STRIDE = 2048, 512, 4096  # an o_proj of 2048 x 2048 bf16 at tp=8: 512 B of every 4 KiB row


def _costs(request_s: float, range_s: float, bandwidth: float) -> Costs:
    """Costs whose measurements say exactly these figures (each recorded as a request alone)."""
    c = Costs("http")
    for _ in range(4):
        c.record(request_s + 1 / bandwidth, 1)  # a 1-byte request
        c.record(request_s + (8 << 20) / bandwidth, 8 << 20)  # a long one
        c.record(request_s + 64 * range_s + 64 / bandwidth, 64, 64)  # 64 ranges of 1 byte
    return c


def test_measured_figures_are_recovered() -> None:
    price = _costs(0.002, 20e-6, 200e6).price(AUTO)
    assert price.request_s == pytest.approx(0.002, rel=1e-3)
    assert price.range_s == pytest.approx(20e-6, rel=1e-3)
    assert price.bandwidth == pytest.approx(200e6, rel=1e-3)


def test_a_request_per_row_is_the_block_unless_the_gap_costs_more_than_a_request() -> None:
    """One range per request: the slices win exactly where a gap's bytes take longer than a request,
    i.e. rows are coalesced up to a gap of request_s * bandwidth."""
    gap = STRIDE - RUN
    for bandwidth in (1e5, 100e6):  # 36 ms and 36 us a gap
        c = _costs(0.01, 0.0, bandwidth)
        assert c.slices(RUN, STRIDE, ROWS, None, AUTO) is (gap / bandwidth > 0.01)


def test_several_ranges_per_request_by_the_server_cost_per_range() -> None:
    """nginx-like (a few us a range) at 100 MB/s: the slices, 1.2 MiB instead of 8 MiB (at 1 GB/s the
    8 MiB take less than 2048 ranges); a Python server at 0.2 ms a range: the block at 1 GB/s, the
    slices over a 1 MB/s link."""
    assert _costs(0.001, 3e-6, 100e6).slices(RUN, STRIDE, ROWS, 256, AUTO)
    assert not _costs(0.001, 3e-6, 1e9).slices(RUN, STRIDE, ROWS, 256, AUTO)
    assert not _costs(0.001, 200e-6, 1e9).slices(RUN, STRIDE, ROWS, 64, AUTO)
    assert _costs(0.001, 200e-6, 1e6).slices(RUN, STRIDE, ROWS, 64, AUTO)


def test_set_figures_and_the_rows_setting_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _costs(0.001, 200e-6, 1e9)  # measured: the block
    assert not c.slices(RUN, STRIDE, ROWS, 64, AUTO)
    assert c.slices(RUN, STRIDE, ROWS, 64, LibrarySettings(store_bandwidth=1e6))  # told the link is slow
    assert c.price(LibrarySettings(store_request_cost=0.5)) == Price(0.5, c.price(AUTO).range_s, c.price(AUTO).bandwidth)
    assert c.slices(RUN, STRIDE, ROWS, 64, LibrarySettings(store_rows="slices"))
    assert not _costs(0.001, 3e-6, 1e6).slices(RUN, STRIDE, ROWS, 256, LibrarySettings(store_rows="blocks"))


def test_a_request_is_charged_its_share_of_those_in_flight() -> None:
    """16 requests in flight, each taking 16 times as long: each costs the stream a sixteenth."""
    import threading
    import time

    c = Costs("s3")
    start = threading.Barrier(16)

    def one() -> None:
        start.wait()
        with c.timed() as got:
            time.sleep(0.16)
            got.append(1)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0.005 < c.price(AUTO).request_s < 0.03  # ~0.01 s each, not 0.16 s

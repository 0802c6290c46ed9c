"""The service's Prometheus metrics, on `prometheus_client`, correct across worker processes.

With one process, each `ServiceMetrics` has its own `CollectorRegistry` (nothing global, so several
apps in one process, as in tests, do not share counts). Under `reshard serve --workers N` the
supervisor sets `PROMETHEUS_MULTIPROC_DIR` before any worker starts: every worker then writes its
samples to files there and a scrape, answered by any worker, adds them up with
`prometheus_client.multiprocess.MultiProcessCollector` (the active-streams gauge sums live workers
only). The jobs-by-state gauge is read at scrape time from the store all workers share.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4  # what scrapers have always accepted
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
prometheus_client.disable_created_metrics()  # no `_created` series: totals are what a scrape wants


def multiprocess_dir() -> Path | None:
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


class _JobsCollector(Collector):
    """`reshard_jobs{state}` from the shared job store, computed at each scrape."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("reshard_jobs", "Write jobs known to the server, by state", labels=["state"])
        for state, n in self.counts().items():
            g.add_metric([state], n)
        yield g


_PID_FILE = re.compile(r"_(\d+)\.db$")


def _forget_dead_workers(directory: Path) -> None:
    """A worker that died (and was replaced) leaves files; its live-only gauges must stop counting."""
    for f in directory.glob("gauge_live*_*.db"):
        m = _PID_FILE.search(f.name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, str(directory))
        except PermissionError:
            pass


class ServiceMetrics:
    """The service's metrics; `job_counts` is called at scrape time for the jobs-by-state gauge."""

    def __init__(self, *, job_counts: Callable[[], dict[str, int]] | None = None) -> None:
        self.shared_dir = multiprocess_dir()
        # in multiprocess mode samples go to files, whatever registry they are registered in
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter("reshard_http_requests", "HTTP requests answered, by method, route and status",
                                ["method", "route", "status"], registry=reg)
        self.request_seconds = Histogram(
            "reshard_http_request_duration_seconds", "Time from request to last response byte, by route", ["route"],
            buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10, 60, 300), registry=reg)
        self.bytes_served = Counter("reshard_shard_bytes_served", "Shard body bytes sent", registry=reg)
        self.bytes_sendfile = Counter("reshard_shard_bytes_sendfile", "Shard body bytes of those sent by the "
                                      "kernel from the source files or copies of gathered pieces (zero-copy send)", registry=reg)
        self.gathered = Counter("reshard_gathered_copies", "Copies of shards' gathered pieces (reshard.service.transport.gathered), "
                                "by event: used (a pull sent them from the copy), written", ["event"], registry=reg)
        self.active_streams = Gauge("reshard_active_streams", "Shard bodies being sent now", registry=reg,
                                    multiprocess_mode="livesum")
        self.streams = Counter("reshard_shard_streams",
                               "Shard bodies by outcome (complete, disconnected, error, timeout)", ["outcome"],
                               registry=reg)
        self.stream_seconds = Histogram("reshard_stream_duration_seconds", "Duration of shard bodies",
                                        buckets=(0.01, 0.05, 0.25, 1, 5, 25, 120, 600), registry=reg)
        self.digests = Counter("reshard_shard_digests", "Shard sha256 digests asked for, by cache result",
                               ["cache"], registry=reg)
        self.store_fetched = Counter("reshard_store_fetched_bytes", "Bytes fetched from the store of a root in a "
                                     "store (cache blocks, headers, JSON files)", registry=reg)
        self.store_cache_hits = Counter("reshard_store_cache_hit_bytes", "Bytes of source ranges read from the "
                                        "node's store cache instead of the store", registry=reg)
        self.uploads = Counter("reshard_uploads", "Checkpoint file uploads, by outcome", ["outcome"], registry=reg)
        self._jobs = _JobsCollector(job_counts or dict)
        if self.shared_dir is None:
            reg.register(self._jobs)

    def render(self) -> bytes:
        """The Prometheus text exposition of every worker's samples."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        _forget_dead_workers(self.shared_dir)
        scrape = CollectorRegistry()
        multiprocess.MultiProcessCollector(scrape, path=str(self.shared_dir))
        scrape.register(self._jobs)
        return generate_latest(scrape)

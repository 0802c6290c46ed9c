"""A small Prometheus text-format (0.0.4) registry: counters, gauges, histograms with labels.

One `ServiceMetrics` lives on `app.state.metrics`; nothing is global, so several apps in one process
(tests) do not share counts. Updates take a lock: they happen a few times per request or chunk.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[LabelValues, float] = {}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (),
                 collect: Callable[[], Iterable[tuple[LabelValues, float]]] | None = None) -> None:
        super().__init__(name, help, labels)
        self._collect = collect

    def dec(self, amount: float = 1.0, *labels: str) -> None:
        self.inc(-amount, *labels)

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self._values[labels] = value

    def render(self) -> list[str]:
        if self._collect is not None:
            for labels, value in self._collect():
                self.set(value, *labels)
        return super().render()


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._data: dict[LabelValues, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            counts, total = self._data.setdefault(labels, ([0] * len(self.buckets), [0.0]))
            for i, b in enumerate(self.buckets):
                if value <= b:
                    counts[i] += 1
                    break
            total[0] += value

    def count(self, *labels: str) -> int:
        data = self._data.get(labels)
        return sum(data[0]) if data else 0

    def render(self) -> list[str]:
        out = self.header()
        with self._lock:
            items = sorted((k, (list(c), t[0])) for k, (c, t) in self._data.items())
        for labels, (counts, total) in items:
            acc = 0
            for b, c in zip(self.buckets, counts, strict=True):
                acc += c
                le = 'le="' + _num(b) + '"'
                out.append(f"{self.name}_bucket{_labels(self.label_names, labels, le)} {acc}")
            out.append(f"{self.name}_sum{_labels(self.label_names, labels)} {_num(total)}")
            out.append(f"{self.name}_count{_labels(self.label_names, labels)} {acc}")
        return out


M = TypeVar("M", bound=_Metric)


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: M) -> M:
        if any(m.name == metric.name for m in self.metrics):
            raise ValueError(f"metric {metric.name} registered twice")
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"


class ServiceMetrics:
    """The service's metrics; `job_counts` is called at scrape time for the jobs-by-state gauge."""

    def __init__(self, *, job_counts: Callable[[], dict[str, int]] | None = None) -> None:
        self.registry = Registry()
        add = self.registry.add
        self.requests: Counter = add(Counter(
            "reshard_http_requests_total", "HTTP requests answered, by method, route and status",
            ("method", "route", "status")))
        self.request_seconds: Histogram = add(Histogram(
            "reshard_http_request_duration_seconds", "Time from request to last response byte, by route",
            (0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10, 60, 300), ("route",)))
        self.bytes_served: Counter = add(Counter(
            "reshard_shard_bytes_served_total", "Shard body bytes sent"))
        self.active_streams: Gauge = add(Gauge(
            "reshard_active_streams", "Shard bodies being sent now"))
        self.streams: Counter = add(Counter(
            "reshard_shard_streams_total", "Shard bodies by outcome (complete, disconnected, error, timeout)", ("outcome",)))
        self.stream_seconds: Histogram = add(Histogram(
            "reshard_stream_duration_seconds", "Duration of shard bodies",
            (0.01, 0.05, 0.25, 1, 5, 25, 120, 600)))
        self.digests: Counter = add(Counter(
            "reshard_shard_digests_total", "Shard sha256 digests asked for, by cache result", ("cache",)))
        self.uploads: Counter = add(Counter(
            "reshard_uploads_total", "Checkpoint file uploads, by outcome", ("outcome",)))

        def jobs() -> list[tuple[LabelValues, float]]:
            counts = job_counts() if job_counts else {}
            return [((state,), float(n)) for state, n in counts.items()]

        self.jobs: Gauge = add(Gauge(
            "reshard_jobs", "Write jobs known to the server, by state", ("state",), collect=jobs))

    def render(self) -> str:
        return self.registry.render()

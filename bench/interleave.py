"""Interleaved comparisons: A B C A B C ... after a warm-up round, medians and per-round ratios.

Every round runs each case once, in the same order, so slow phases of a shared, noisy machine hit
all cases alike; the ratio of a case to the baseline is computed within each round and the median
of those ratios is reported next to the medians of the times.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.measure import Result, median, run_command

MiB = 1 << 20


@dataclass
class Case:
    """One command of a comparison.

    `argv` is the command; `setup` runs before each timed run and `teardown` after it, both outside
    the timing (remove the previous output, sync dirty pages, start a client's server...). `runner`
    replaces `run_command` for cases that time something other than one subprocess.
    """

    name: str
    argv: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    watch: Callable[[], dict[str, int]] | None = None
    runner: Callable[[Case], Result] | None = None
    extra: Callable[[Result], dict[str, Any]] | None = None
    note: str = ""


def _once(case: Case) -> tuple[Result, dict[str, Any]]:
    if case.setup:
        case.setup()
    try:
        if case.runner is not None:
            res = case.runner(case)
        else:
            res = run_command(case.name, case.argv, env=case.env, watch=case.watch() if case.watch else None)
        extra = case.extra(res) if case.extra else {}
    finally:
        if case.teardown:
            case.teardown()
    return res, extra


def interleave(
    title: str,
    cases: Sequence[Case],
    *,
    reps: int = 3,
    warmup: int = 1,
    baseline: str | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `warmup` untimed rounds then `reps` timed rounds of all `cases`; summarise."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    baseline = baseline or cases[0].name
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
    for r in range(warmup + reps):
        timed = r >= warmup
        for c in cases:
            res, extra = _once(c)
            tag = f"rep {r - warmup + 1}/{reps}" if timed else "warm-up"
            log(f"  [{title}] {tag:>9} {c.name:<34} {res.wall_s:8.3f} s  peak RssAnon {res.peak_rss_anon / MiB:7.1f} MiB")
            if timed:
                runs[c.name].append(_run_record(res, extra))
    return summarise(title, cases, runs, baseline)


def _run_record(res: Result, extra: dict[str, Any]) -> dict[str, Any]:
    rec: dict[str, Any] = {"wall_s": res.wall_s, "peak_rss_anon_bytes": res.peak_rss_anon, "samples": res.samples}
    if res.watched_peak:
        rec["watched_peak_rss_anon_bytes"] = dict(res.watched_peak)
        rec["watched_base_rss_anon_bytes"] = dict(res.watched_base)
    rec.update(extra)
    return rec


def summarise(title: str, cases: Sequence[Case], runs: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, Any]:
    base = [r["wall_s"] for r in runs[baseline]]
    out: dict[str, Any] = {"title": title, "baseline": baseline, "cases": {}}
    for c in cases:
        walls = [r["wall_s"] for r in runs[c.name]]
        ratios = [w / b for w, b in zip(walls, base) if b > 0]
        peaks = [r["peak_rss_anon_bytes"] for r in runs[c.name]]
        entry: dict[str, Any] = {
            "argv": [str(a) for a in c.argv],
            "note": c.note,
            "runs": runs[c.name],
            "median_s": median(walls),
            "min_s": min(walls) if walls else None,
            "ratio_to_baseline": median(ratios),
            "peak_rss_anon_mib": max(peaks) / MiB if peaks else None,
            "median_peak_rss_anon_mib": median(peaks) / MiB if peaks else None,
        }
        watched = [r.get("watched_peak_rss_anon_bytes") for r in runs[c.name] if r.get("watched_peak_rss_anon_bytes")]
        if watched:
            entry["watched_peak_rss_anon_mib"] = {k: max(w[k] for w in watched) / MiB for k in watched[0]}
        out["cases"][c.name] = entry
    return out


def drop_dirty() -> None:
    """Flush dirty pages (outside timing) so one run's write-back does not slow the next."""
    os.sync()

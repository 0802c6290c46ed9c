"""`python -m bench [--full] [--only write,serve,train,fill]`: the side-by-side benchmark suite.

Quick mode (default, a few minutes): the 1 GB checkpoint, 3 interleaved reps, the main variant of
each comparison. Full mode (~30 minutes): also tp=2 and tp=8, tp=4 shards -> tp=2, the 4 GB
checkpoint (deleted afterwards unless --keep-data), row-split ranks and 4 concurrent clients.
Results: `bench/results/{quick,full}.{json,png,md}`; the markdown table is also printed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import data
from bench.compare_write import memory_summary, run_write
from bench.report import markdown, save
from bench.targets import evaluate

RESULTS = Path(__file__).resolve().parent / "results"
COMPARISONS = ("write", "serve", "train", "plan", "fill")
QUICK = ("write", "serve", "train", "plan")  # fill (TP worker start-up, ~1 min a round) only with --full or --only


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        mem = 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} x {cpu}, {mem / 2**20:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}, load average {load:.1f} at start (shared machine)")


def git_state() -> dict[str, Any]:
    """The commit measured, and which source files differed from it (results must name what they measured)."""
    repo = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True, check=False)
        return r.stdout.rstrip()

    dirty = [ln[3:] for ln in git("status", "--porcelain", "--", "reshard", "service").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "uncommitted": dirty}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="the full suite (~30 min) instead of quick mode (<5 min)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(COMPARISONS)} "
                   f"(default: all with --full, else {','.join(QUICK)})")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per comparison (after one warm-up round)")
    p.add_argument("--data", type=Path, default=data.DATA, help="where checkpoints and outputs go (git-ignored)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    p.add_argument("--size", choices=sorted(data.SIZES), default=None, help=argparse.SUPPRESS)
    p.add_argument("--keep-data", action="store_true", help="keep the 4 GB checkpoint after a full run")
    args = p.parse_args(argv)
    only = args.only if args.only is not None else ",".join(COMPARISONS if args.full else QUICK)
    args.only = [x.strip() for x in only.split(",") if x.strip()]
    unknown = set(args.only) - set(COMPARISONS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(COMPARISONS)}")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    mode = "full" if args.full else "quick"
    small = args.size or "1gb"
    results: dict[str, Any] = {
        "meta": {"mode": mode, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                 "reps": args.reps, "warmup": 1, "git": git_state(), "page_cache": "warm (a warm-up round runs first; caches not dropped)"},
        "comparisons": [],
    }
    ckpts = {"1gb": data.checkpoint(small, root=args.data)}
    if args.full and "write" in args.only:
        ckpts["4gb"] = data.checkpoint("4gb", root=args.data)
    for p in ckpts.values():
        data.warm_page_cache(p)
    work = args.data / "work"
    try:
        if "write" in args.only:
            log("bench: comparison 1-2, reshard write")
            comps = run_write(ckpts, work, full=args.full, reps=args.reps)
            results["comparisons"] += comps
            results["memory"] = memory_summary(comps)
        if "serve" in args.only:
            from bench.compare_serve import run_serve

            log("bench: comparison 3, service")
            results["comparisons"] += run_serve(ckpts["1gb"], work, full=args.full, reps=args.reps)
        if "plan" in args.only:
            from bench.compare_plan import run_plan

            log("bench: comparison 5, planning 100,000 tensors")
            results["comparisons"] += run_plan(args.data, work, reps=args.reps)
        if "train" in args.only:
            from bench.compare_train import run_train

            log("bench: comparison 4, trainer start-up")
            results["comparisons"] += run_train(ckpts["1gb"], work, full=args.full, reps=args.reps)
        if "fill" in args.only:
            from bench.compare_fill import run_fill

            log("bench: comparison 5, TP worker start-up (transformers from_pretrained vs fill_model)")
            results["comparisons"] += run_fill(ckpts["1gb"], work, full=args.full, reps=args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if "4gb" in ckpts and not args.keep_data:
            shutil.rmtree(ckpts["4gb"], ignore_errors=True)
    results["targets"] = evaluate(results)
    results["meta"]["elapsed_s"] = time.perf_counter() - t0
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    paths = save(results, args.out)
    print(markdown(results))
    log(f"bench: {results['meta']['elapsed_s']:.0f} s; results in {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

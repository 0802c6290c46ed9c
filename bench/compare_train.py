"""Comparison 4: trainer start-up at tp=2, shards pulled from `reshard serve` vs read from local files
(and, with RESHARD_RETIRED_TREE set to a source tree of the retired hand-written model, vs that model).

`torchrun --nproc-per-node 2 -m reshard.cli.train --steps 1` with `RESHARD_T0` set at launch, so the
trainer's `time_to_first_step_s` counts from launch (it includes interpreter and torch start-up,
process-group set-up, filling the parameters and one optimizer step; `load_s` stops once the model
is filled). Bytes per rank: the trainer's `shard_bytes_per_rank`, cross-checked against the growth of
the service's `reshard_shard_bytes_served_total` counter during the run, and against the plan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.compare_write import reshard_bin
from bench.interleave import Case, interleave
from bench.measure import Result, run_command
from bench.servers import reshard_serve_argv
from reshard.testing.local_servers import free_port, server

TP = 2
NAME = "llama"
# a tiny first step in the stored dtype (bf16): the comparison is about getting the weights in
TRAIN_ARGS = ["--steps", "1", "--seq-len", "16", "--batch-size", "1", "--dtype", "keep"]
_SERVED = re.compile(r"^reshard_shard_bytes_served_total(?:\{[^}]*\})?\s+([0-9.e+]+)\s*$", re.M)


def torchrun() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else shutil.which("torchrun") or "torchrun"


def bytes_served(base: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(x) for x in _SERVED.findall(text))


def expected_bytes(src: Path, tp: int) -> dict[str, Any]:
    """From the plan (headers only): each rank's file size and the full checkpoint's tensor bytes."""
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    ckpt, manifest = open_source(src)
    plan = make_plan(ckpt, manifest, tp)
    stats = [rp.stats() for rp in plan.ranks]
    return {"per_rank": [s["bytes"] for s in stats], "replicated_per_rank": stats[0]["replicated_bytes"],
            "full": ckpt.total_bytes()}


RETIRED_ENV = "RESHARD_RETIRED_TREE"  # a source tree of the retired hand-written trainer (see run_train)


def train_case(name: str, shards: str, work: Path, base_url: str | None, *, pythonpath: str | None = None,
               launcher: str = "torchrun") -> Case:
    metrics = work / f"metrics-{name}.json"

    def runner(case: Case) -> Result:
        if metrics.exists():
            metrics.unlink()
        before = bytes_served(base_url) if base_url else 0.0
        start = [torchrun()] if launcher == "torchrun" else [sys.executable, "-m", "reshard.cli.launch"]  # reshard launch
        argv = [*start, "--nproc-per-node", str(TP), "--master-addr", "127.0.0.1", "--master-port",
                str(free_port()), "-m", "reshard.cli.train", "--shards", shards, "--metrics", str(metrics), *TRAIN_ARGS]
        env = {"RESHARD_T0": repr(time.time()), "OMP_NUM_THREADS": "1", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
        res = run_command(case.name, argv, env=env, watch=case.watch() if case.watch else None, timeout=900)
        m = json.loads(metrics.read_text())
        served = (bytes_served(base_url) - before) if base_url else None
        res.stdout = json.dumps({"metrics": m, "served": served, "process_wall_s": res.wall_s})
        res.wall_s = m["time_to_first_step_s"]  # the comparison is on time to first step
        return res

    def extra(res: Result) -> dict[str, Any]:
        d = json.loads(res.stdout)
        m = d["metrics"]
        return {"time_to_first_step_s": m["time_to_first_step_s"], "load_s": m["load_s"],
                "process_wall_s": d["process_wall_s"],
                "shard_bytes_per_rank": m["shard_bytes_per_rank"], "bytes_served_by_service": d["served"]}

    model = f", retired hand-written model from {pythonpath}" if pythonpath else ", transformers' own model"
    return Case(name, [torchrun(), "-m", "reshard.cli.train", "--shards", shards, *TRAIN_ARGS], runner=runner, extra=extra,
                note=f"{'torchrun' if launcher == 'torchrun' else 'reshard launch'} --nproc-per-node {TP}, shards from {'the service' if base_url else 'local files'}{model}")


def prewarm(base: str, shards: Path) -> None:
    """What a warm-up round would leave behind: shard files in the page cache, the service's plan and
    digest caches filled (and with them the source files read into the page cache)."""
    from bench.data import warm_page_cache

    warm_page_cache(shards)
    for rank in range(TP):
        with urllib.request.urlopen(f"{base}/v1/checkpoints/{NAME}/shards/{rank}/digest?tp={TP}", timeout=300) as r:
            r.read()


def run_train(src: Path, work: Path, *, full: bool, reps: int) -> list[dict[str, Any]]:
    work = work / "train"
    root, shards = work / "root", work / f"tp{TP}"
    (root / NAME).mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix in (".safetensors", ".json") and p.name != "bench-ckpt.json" and not (root / NAME / p.name).exists():
            os.link(p, root / NAME / p.name)
    if not shards.exists():
        subprocess.run([reshard_bin(), "write", str(src), "--tp", str(TP), "-o", str(shards), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
    expected = expected_bytes(src, TP)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(reshard_serve_argv(root, port), f"{base}/healthz", log=work / "serve.log") as srv:
        cases = [train_case("disk", str(shards), work, None),
                 train_case("http", f"{base}/v1/checkpoints/{NAME}", work, base)]
        cases[1].watch = lambda: {"server": srv.pid}
        retired = os.environ.get(RETIRED_ENV)  # e.g. `git archive 27e0a50 | tar -x -C /tmp/retired`
        if retired:
            cases.append(train_case("disk-retired", str(shards), work, None, pythonpath=retired))
        if not full:
            prewarm(base, shards)
        # quick mode: the explicit pre-warm above replaces a warm-up round of two ~20 s trainer runs
        res = interleave("trainer start-up tp2", cases, reps=reps, warmup=1 if full else 0, baseline="disk")
        res["warmup"] = "one untimed round of both" if full else "pre-warm: shards read once, service digests computed"
    for c in res["cases"].values():
        # wall_s is the trainer's time to first step (from launch); load_s and the process wall beside it
        for key in ("time_to_first_step_s", "load_s", "process_wall_s"):
            c[f"median_{key}"] = sorted(r[key] for r in c["runs"])[len(c["runs"]) // 2]
    ttfs = [(h["time_to_first_step_s"], d["time_to_first_step_s"]) for h, d in
            zip(res["cases"]["http"]["runs"], res["cases"]["disk"]["runs"])]
    loads = [(h["load_s"], d["load_s"]) for h, d in zip(res["cases"]["http"]["runs"], res["cases"]["disk"]["runs"])]
    res["ratio_time_to_first_step"] = sorted(a / b for a, b in ttfs)[len(ttfs) // 2]
    res["ratio_load"] = sorted(a / b for a, b in loads)[len(loads) // 2]
    if "disk-retired" in res["cases"]:  # the transformers model path vs the retired hand-written model
        pairs = zip(res["cases"]["disk"]["runs"], res["cases"]["disk-retired"]["runs"])
        res["ratio_time_to_first_step_vs_retired"] = sorted(
            a["time_to_first_step_s"] / b["time_to_first_step_s"] for a, b in pairs)[len(ttfs) // 2]
    http_runs = res["cases"]["http"]["runs"]
    per_rank = http_runs[-1]["shard_bytes_per_rank"]
    res["bytes"] = {
        "http_per_rank": per_rank, "disk_per_rank": res["cases"]["disk"]["runs"][-1]["shard_bytes_per_rank"],
        "served_by_service_per_run": [r["bytes_served_by_service"] for r in http_runs],
        "expected_per_rank": max(expected["per_rank"]), "plan_per_rank": expected["per_rank"],
        "replicated_per_rank": expected["replicated_per_rank"], "full": expected["full"],
        "max_rank_fraction_of_full": max(per_rank) / expected["full"],
    }
    res.update(tp=TP)
    return [res]

"""Comparison 5: TP worker start-up at tp=2 on the 1 GB checkpoint, transformers'
`from_pretrained(path, tp_plan="auto")` on the full checkpoint vs `empty_tp_model` + `fill_model` from
`reshard serve`, interleaved (`bench/fill_worker.py` under torchrun; not in quick mode: ~1 min a round).

Time: until the model is ready on every rank, from launch (the slower rank's `ready_s`), and the
in-process load time. Bytes per rank: `fill_model`'s report, cross-checked against the growth of the
service's `reshard_shard_bytes_served_total`, and the plan's rank file size; `from_pretrained` maps
the whole checkpoint in every rank (safetensors mmap: the pages it touches are not counted per process,
so the table gives the checkpoint bytes each rank needs at hand, and /proc/self/io's read counters).
The logits of 8 fixed tokens must agree between the two (checksum per run).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from bench.compare_train import bytes_served, expected_bytes, torchrun
from bench.interleave import Case, interleave
from bench.measure import Result, median, run_command
from bench.servers import free_port, reshard_serve_argv, server

TP = 2
NAME = "llama"


def worker_case(name: str, mode: str, source: str, work: Path, base_url: str | None) -> Case:
    out = work / f"out-{name}"

    def runner(case: Case) -> Result:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        before = bytes_served(base_url) if base_url else 0.0
        argv = [torchrun(), "--nproc-per-node", str(TP), "--master-addr", "127.0.0.1", "--master-port",
                str(free_port()), "-m", "bench.fill_worker", mode, source, str(out)]
        env = {"RESHARD_T0": repr(time.time()), "OMP_NUM_THREADS": "1"}
        res = run_command(case.name, argv, env=env, watch=case.watch() if case.watch else None, timeout=900)
        ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(TP)]
        served = (bytes_served(base_url) - before) if base_url else None
        res.stdout = json.dumps({"ranks": ranks, "served": served, "process_wall_s": res.wall_s})
        res.wall_s = max(r["ready_s"] for r in ranks)  # ready on every rank, from launch
        return res

    def extra(res: Result) -> dict[str, Any]:
        d = json.loads(res.stdout)
        ranks = d["ranks"]
        return {"ready_s": max(r["ready_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
                "process_wall_s": d["process_wall_s"], "bytes_pulled_per_rank": [r["bytes_pulled"] for r in ranks],
                "read_bytes_per_rank": [r["read_bytes"] for r in ranks], "rchar_per_rank": [r["rchar"] for r in ranks],
                "bytes_served_by_service": d["served"], "logits_sum": [r["logits_sum"] for r in ranks],
                "dtype": ranks[0]["dtype"], "rss_anon_mib_per_rank": [r["rss_anon_mib"] for r in ranks],
                "rss_file_mib_per_rank": [r["rss_file_mib"] for r in ranks]}

    return Case(name, [torchrun(), "-m", "bench.fill_worker", mode, source], runner=runner, extra=extra,
                note=f"torchrun --nproc-per-node {TP}: {mode} from {'the service' if base_url else 'the full checkpoint'}")


def run_fill(src: Path, work: Path, *, full: bool, reps: int) -> list[dict[str, Any]]:
    work = work / "fill"
    root = work / "root"
    (root / NAME).mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix in (".safetensors", ".json") and p.name != "bench-ckpt.json" and not (root / NAME / p.name).exists():
            os.link(p, root / NAME / p.name)
    expected = expected_bytes(src, TP)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(reshard_serve_argv(root, port), f"{base}/healthz", log=work / "serve.log") as srv:
        cases = [worker_case("from_pretrained", "from_pretrained", str(root / NAME), work, None),
                 worker_case("fill_model", "fill", f"{base}/v1/checkpoints/{NAME}", work, base)]
        cases[1].watch = lambda: {"server": srv.pid}
        res = interleave("TP worker start-up tp2", cases, reps=reps, warmup=1, baseline="from_pretrained")
    runs = {name: c["runs"] for name, c in res["cases"].items()}
    for c in res["cases"].values():
        for key in ("ready_s", "load_s", "process_wall_s"):
            c[f"median_{key}"] = median([r[key] for r in c["runs"]])
    pairs = list(zip(runs["fill_model"], runs["from_pretrained"]))
    res["fill_ratio_ready"] = median([f["ready_s"] / t["ready_s"] for f, t in pairs])
    res["fill_ratio_load"] = median([f["load_s"] / t["load_s"] for f, t in pairs])
    res["logits_agree"] = all(max(abs(a - b) for a, b in zip(f["logits_sum"], t["logits_sum"])) < 1e-3 * max(
        1.0, abs(t["logits_sum"][0])) for f, t in pairs)
    pulled = runs["fill_model"][-1]["bytes_pulled_per_rank"]
    res["bytes"] = {
        "fill_pulled_per_rank": pulled, "served_by_service_per_run": [r["bytes_served_by_service"] for r in runs["fill_model"]],
        "plan_per_rank": expected["per_rank"], "from_pretrained_mapped_per_rank": expected["full"],
        "from_pretrained_read_bytes_per_rank": runs["from_pretrained"][-1]["read_bytes_per_rank"],
        "max_rank_fraction_of_full": max(pulled) / expected["full"],
    }
    res.update(tp=TP, mode="full" if full else "quick")
    return [res]


if __name__ == "__main__":  # python -m bench.compare_fill [REPS]: this comparison alone
    import sys

    from bench import data

    ckpt = data.checkpoint("1gb")
    data.warm_page_cache(ckpt)
    out = run_fill(ckpt, data.DATA / "work", full=True, reps=int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    print(json.dumps(out, indent=2, default=str))

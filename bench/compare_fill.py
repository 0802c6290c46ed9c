"""TP worker start-up on the 1 GB checkpoint at tp=2 and tp=4 (issue 23, item 3), interleaved:

- torchrun + `from_pretrained(path, tp_plan="auto")` on the full checkpoint: the baseline, as a new user runs it;
- torchrun + `empty_tp_model` + `fill_model` from `reshard serve` (the rank's shard, and `follow="model"`:
  the boxes the model's DTensors hold, issue 35 item 3), and from local rank files;
- `reshard launch` (one import, forked ranks) + the same fills, and + `from_pretrained`, so the table
  says what the launcher alone gives.

Every case runs `bench/fill_worker.py` per rank. Time: launch until every rank's model is ready (the
slower rank's `ready_s`). Memory per rank: VmHWM when ready and the post-import baseline (VmRSS once
torch, transformers and the model class are imported); the growth is their difference. Bytes per
rank: the fill's report (the whole rank file), cross-checked with the service's counter. The logits
of 8 fixed tokens must agree between all runs.

    python -m bench.compare_fill [--reps 3] [--tp 2,4]   # writes bench/results/fill.json
    python -m bench.compare_fill --torchrun --tp 2 --no-trainer --out bench/results/fill_torchrun.json
                                                         # the torchrun cases alone (issue 35, item 3)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.compare_train import bytes_served, expected_bytes, torchrun, train_case
from bench.interleave import Case, interleave
from bench.measure import Result, median, run_command
from bench.servers import reshard_serve_argv
from reshard.testing.local_servers import free_port, server

TPS = (2, 4)
NAME = "llama"
BASELINE = "torchrun + from_pretrained"
LAUNCH_FP = "launch + from_pretrained"
PREFETCH = "launch --prefetch + fill (service)"
FOLLOW = "torchrun + fill follow=model (service)"
RESULTS = Path(__file__).resolve().parent / "results" / "fill.json"


def launcher_argv(launcher: str, tp: int, preload: str, flags: Sequence[str] = ()) -> list[str]:
    """torchrun as a user runs it, or `reshard launch` importing the checkpoint's classes before the fork."""
    if launcher == "torchrun":
        return [torchrun(), "--nproc-per-node", str(tp), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return [sys.executable, "-m", "reshard.cli.launch", "--nproc-per-node", str(tp), "--preload", preload, *flags]


def worker_case(name: str, launcher: str, mode: str, source: str, tp: int, out: Path,
                counter: Callable[[], float] | None, *, prepare: Callable[[], None] | None = None,
                flags: Sequence[str] = ()) -> Case:
    """`prepare()` then `launcher_argv` (a fresh port each run) + the worker, timed from before
    `prepare`; time = the slower rank's ready_s. `counter()`: bytes served (or sent over a link) so far."""

    def runner(case: Case) -> Result:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        before = counter() if counter else 0.0
        t0 = time.time()
        if prepare is not None:
            prepare()
        cmd = [*launcher_argv(launcher, tp, source, flags), "-m", "bench.fill_worker", mode, source, str(out)]
        res = run_command(case.name, cmd, env={"RESHARD_T0": repr(t0), "OMP_NUM_THREADS": "1",
                                               "PYTHONWARNINGS": "ignore"}, timeout=900)
        ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(tp)]
        served = (counter() - before) if counter else None
        res.stdout = json.dumps({"ranks": ranks, "served": served, "process_wall_s": res.wall_s})
        res.wall_s = max(r["ready_s"] for r in ranks)  # ready on every rank, from launch
        return res

    def extra(res: Result) -> dict[str, Any]:
        d = json.loads(res.stdout)
        ranks = d["ranks"]
        per = {k: [r.get(k) for r in ranks] for k in ("ready_s", "start_s", "load_s", "base_rss_mib", "hwm_mib",
                                                       "rss_anon_mib", "rss_file_mib", "rss_shmem_mib", "param_mib",
                                                       "bytes_pulled", "mapped", "verified", "read_bytes", "logits_sum")}
        return {"ready_s": max(per["ready_s"]), "load_s": max(per["load_s"]), "process_wall_s": d["process_wall_s"],
                "counted_bytes": d["served"], "growth_mib": [h - b for h, b in zip(per["hwm_mib"],
                                                                                           per["base_rss_mib"])],
                **{f"{k}_per_rank": v for k, v in per.items()}}

    return Case(name, [mode, source], runner=runner, extra=extra, note=f"{mode} from {source}")


def cases_for(tp: int, ckpt: str, url: str, ranks_dir: str, work: Path, base: str, *,
              torchrun_only: bool = False) -> list[Case]:
    fp, fill = "from_pretrained", "fill"
    plan = [(BASELINE, "torchrun", fp, ckpt, None), ("torchrun + fill (service)", "torchrun", fill, url, base),
            (FOLLOW, "torchrun", "fill-model", url, base),
            ("torchrun + fill (rank files)", "torchrun", fill, ranks_dir, None),
            (LAUNCH_FP, "launch", fp, ckpt, None), ("launch + fill (service)", "launch", fill, url, base),
            ("launch + fill (rank files)", "launch", fill, ranks_dir, None),
            (PREFETCH, "launch", fill, url, base)]
    plan = [p for p in plan if p[1] == "torchrun"] if torchrun_only else plan
    out = []
    for i, (name, launcher, mode, source, served) in enumerate(plan):
        count = (lambda: bytes_served(base)) if served else None
        flags = ("--prefetch", url) if name == PREFETCH else ()
        out.append(worker_case(name, launcher, mode, source, tp, work / f"out-{tp}-{i}", count, flags=flags))
    return out


TRAINER = (("torchrun, rank files", "torchrun", False), ("torchrun, service", "torchrun", True),
           ("reshard launch, rank files", "launch", False), ("reshard launch, service", "launch", True))


def run_trainer(url: str, ranks_dir: Path, work: Path, base: str, reps: int) -> dict[str, Any]:
    """The bundled trainer's start-up (`-m reshard.cli.train --steps 1 --dtype keep`, tp=2) under torchrun
    and under `reshard launch`: time to the first step and to the filled model, from launch."""
    cases = [train_case(name, url if http else str(ranks_dir), work, base if http else None, launcher=launcher)
             for name, launcher, http in TRAINER]
    res = interleave("trainer start-up tp2, torchrun vs reshard launch", cases, reps=reps, warmup=1,
                     baseline=TRAINER[0][0])
    for c in res["cases"].values():
        for key in ("time_to_first_step_s", "load_s"):
            c[f"median_{key}"] = median([r[key] for r in c["runs"]])
    for name, _, http in TRAINER[2:]:
        ref = res["cases"][TRAINER[1 if http else 0][0]]["runs"]
        res["cases"][name]["ratio_to_torchrun"] = median(
            [a["time_to_first_step_s"] / b["time_to_first_step_s"] for a, b in zip(res["cases"][name]["runs"], ref)])
    res.update(tp=2)
    return res


def summarise(res: dict[str, Any], tp: int, expected: dict[str, Any], *, reference: str = LAUNCH_FP) -> dict[str, Any]:
    """Medians and per-rank figures of each case, its ratio to `reference` (per round), whether the logits agree."""
    cases = res["cases"]
    for c in cases.values():
        runs = c["runs"]
        for key in ("ready_s", "load_s", "process_wall_s"):
            c[f"median_{key}"] = median([r[key] for r in runs])
        c["median_start_s"] = median([max(r["start_s_per_rank"]) for r in runs])
        c["max_growth_mib"] = max(max(r["growth_mib"]) for r in runs)
        c["param_mib"] = max(runs[-1]["param_mib_per_rank"])
        c["median_base_rss_mib"] = median([max(r["base_rss_mib_per_rank"]) for r in runs])
        c["bytes_per_rank"] = runs[-1]["bytes_pulled_per_rank"]
        c["mapped_per_rank"] = runs[-1]["mapped_per_rank"]
        c["verified"] = sorted({v for r in runs for v in r["verified_per_rank"] if v})
        c["ratio_to_launch_fp"] = median([a["ready_s"] / b["ready_s"] for a, b in zip(runs, cases[reference]["runs"])]
                                         ) if reference in cases else None
        c["median_counted_bytes"] = median([r["counted_bytes"] for r in runs]) if runs[0]["counted_bytes"] is not None else None
    sums = [s for c in cases.values() for r in c["runs"] for s in r["logits_sum_per_rank"]]
    res["logits_agree"] = max(sums) - min(sums) <= 1e-3 * max(1.0, abs(sums[0]))
    res["logits_sum"] = sums[0]
    res["bytes"] = {"plan_per_rank": expected["per_rank"], "full": expected["full"]}
    res.update(tp=tp)
    return res


def write_rank_files(ckpt: Path, tp: int, out: Path) -> Path:
    """`reshard write` (which records each file's identity: a fill trusts the recorded sha256)."""
    if not (out / "reshard.json").is_file():
        subprocess.run([sys.executable, "-m", "reshard.cli", "write", str(ckpt), "--tp", str(tp), "-o", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def linked_root(src: Path, work: Path) -> Path:
    """A service root `work/root` whose checkpoint NAME is `src`'s files, hard-linked."""
    root = work / "root"
    (root / NAME).mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix in (".safetensors", ".json") and p.name != "bench-ckpt.json" and not (root / NAME / p.name).exists():
            os.link(p, root / NAME / p.name)
    return root


def run_fill(src: Path, work: Path, *, full: bool = True, reps: int = 3, tps: tuple[int, ...] = TPS,
             trainer: bool = True, torchrun_only: bool = False) -> list[dict[str, Any]]:
    """The TP worker comparisons (one per tp) and the trainer's, all against one `reshard serve`."""
    work = work / "fill"
    root = linked_root(src, work)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    comps = []
    with server(reshard_serve_argv(root, port), f"{base}/healthz", log=work / "serve.log"):
        for tp in tps:
            ranks_dir = write_rank_files(root / NAME, tp, work / f"ranks-tp{tp}")
            cases = cases_for(tp, str(root / NAME), f"{base}/v1/checkpoints/{NAME}", str(ranks_dir), work, base,
                              torchrun_only=torchrun_only)
            res = interleave(f"TP worker start-up tp{tp}", cases, reps=reps, warmup=1, baseline=BASELINE)
            comps.append(summarise(res, tp, expected_bytes(src, tp)))
        if trainer:
            ranks_dir = write_rank_files(root / NAME, 2, work / "ranks-tp2")
            comps.append(run_trainer(f"{base}/v1/checkpoints/{NAME}", ranks_dir, work, base, reps))
    return comps


def common_args(p: argparse.ArgumentParser, out: Path) -> None:
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--data", type=Path, default=None, help="where the checkpoint and work files go (bench/data)")


def prepared(args: argparse.Namespace, command: str) -> tuple[Path, Path, dict[str, Any]]:
    """(data root, the 1 GB checkpoint in the page cache, the results' meta) for a standalone run."""
    from bench import data
    from bench.run import git_state, machine

    root = args.data or data.DATA
    ckpt = data.checkpoint("1gb", root=root)
    data.warm_page_cache(ckpt)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "reps": args.reps, "warmup": 1,
            "git": git_state(), "command": command}
    return root, ckpt, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_fill", description=__doc__.split("\n\n")[0])
    common_args(p, RESULTS)
    p.add_argument("--tp", default=",".join(map(str, TPS)))
    p.add_argument("--no-trainer", action="store_true", help="leave out the trainer's comparison")
    p.add_argument("--torchrun", action="store_true", help="only the cases under torchrun (no `reshard launch`)")
    args = p.parse_args(argv)
    from bench.targets import fill_targets

    flags = "".join(f" {f}" for f, on in (("--torchrun", args.torchrun), ("--no-trainer", args.no_trainer)) if on)
    out = "" if args.out == RESULTS else f" --out {os.path.relpath(args.out)}"
    root, ckpt, meta = prepared(args, f"python -m bench.compare_fill --reps {args.reps} --tp {args.tp}{flags}{out}")
    comps = run_fill(ckpt, root / "work", reps=args.reps, tps=tuple(int(x) for x in args.tp.split(",")),
                     trainer=not args.no_trainer, torchrun_only=args.torchrun)
    meta["load_at_end"] = os.getloadavg()[0]
    results = {"meta": meta, "comparisons": comps, "targets": fill_targets({"comparisons": comps})}
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    for t in results["targets"]:
        print(f"{t['target']}: {t['value']} (goal {t['goal']}, met: {t['met']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

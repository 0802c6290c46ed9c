"""Training checkpoints at tp=2 against torch DCP: save time, resume time at another layout, peak RSS per rank.

    python -m bench.compare_checkpoint [--reps 3] [--steps 2] [--size quick|tiny]

One run, the same model and state for every case: a llama of `reshard.testing.synth` (`quick`: 62 M
parameters, 250 MB in float32; vocabulary and heads even at tp=2, so every tensor's cut is a DTensor
placement), its tp=2 rank shards, two gloo ranks under torchrun that train `--steps` steps (AdamW's
moments exist), then `--reps` interleaved rounds after a warm-up round of (`bench/checkpoint_worker.py`):

  reshard save_checkpoint      the bundled trainer's checkpoint: rank files of parameters and moments,
                               each rank its own share, sha256 of each, trainer_state.json, one rename
  dcp.save (DTensor)           the same tensors as DTensors on a 1-D mesh (Shard(d) where the rank header
                               says the rank holds a slice of dim d, else Replicate): what DCP can reshard
  dcp.save (plain, per rank)   the same tensors as plain tensors under per-rank keys (each rank its own)
  dcp.async_save (DTensor)     the time until it returns (blocking) and until its future is done

each timed between two barriers (the slower rank's time), the page cache's dirty pages written back
before each. Then the tp=2 checkpoints resumed at tp=1, one fresh process a run, interleaved: reshard's
`build_model(relayout=True)` + `restore_training` against `dcp.load` into DTensors of the tp=1 layout;
the loaded tensors' sha256 must agree. Peak RssAnon is sampled in each rank every 10 ms. Megatron's
`fully_reshardable` is an anchor described, not run. Writes `bench/results/checkpoint.{md,json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import data
from bench.checkpoint_worker import DCP_ASYNC, DCP_DT, DCP_PLAIN, RESHARD
from bench.compare_train import torchrun
from bench.measure import median, run_command
from bench.report import targets_table, write_md_json
from reshard.testing.local_servers import free_port

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]  # the repository: `-m bench.checkpoint_worker` runs from it
MODELS: dict[str, dict[str, int]] = {
    "quick": {"vocab_size": 16000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
              "num_attention_heads": 12, "num_key_value_heads": 4},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},  # the smoke test's
}
RSS_GOAL_MIB = 64
ENV = {"OMP_NUM_THREADS": "1", "NO_PROXY": "127.0.0.1,localhost"}
SAVE_CASES = (RESHARD, DCP_DT, DCP_PLAIN, DCP_ASYNC)
LOAD_CASES = {"reshard resume (build_model relayout + restore_training)": "resume-reshard",
              "dcp.load (DTensor, tp=1 mesh)": "resume-dcp"}


def shards(size: str, root: Path = data.DATA) -> Path:
    """The tp=2 rank shards of the `size` model (generated once, reused while the stamp matches)."""
    from reshard.io.sinks.write import write_shards
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan
    from reshard.testing.synth import llama_config, make_checkpoint

    full, out = root / f"ckpt-llama-{size}", root / f"ckpt-llama-{size}-tp2"
    stamp = out / data.STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == MODELS[size]:
        return out
    for p in (full, out):
        shutil.rmtree(p, ignore_errors=True)
    make_checkpoint(full, llama_config(**MODELS[size]), seed=0)
    ckpt, manifest = open_source(full)
    write_shards(ckpt, make_plan(ckpt, manifest, 2), out, progress=False)
    shutil.rmtree(full)
    stamp.write_text(json.dumps(MODELS[size], sort_keys=True))
    return out


def run_saves(src: Path, work: Path, *, reps: int, steps: int) -> dict[str, Any]:
    argv = [torchrun(), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "bench.checkpoint_worker", "save", str(src), str(work), "--reps", str(reps), "--steps", str(steps)]
    res = run_command("saves", argv, env=ENV, cwd=ROOT, timeout=1800)
    ranks = [json.loads((work / f"save-rank-{r}.json").read_text()) for r in range(2)]
    cases: dict[str, Any] = {}
    for name in SAVE_CASES:
        rounds = list(zip(*(rk["runs"][name] for rk in ranks), strict=True))
        walls = [max(r["s"] for r in rd) for rd in rounds]
        base = [max(r["s"] for r in rd) for rd in zip(*(rk["runs"][DCP_DT] for rk in ranks), strict=True)]
        cases[name] = {
            "median_s": median(walls), "runs_s": walls, "ratio_to_baseline": median(w / b for w, b in zip(walls, base, strict=True)),
            "median_blocking_s": median(max(r["blocking_s"] for r in rd) for rd in rounds) if name == DCP_ASYNC else None,
            "peak_growth_mib_per_rank": [max(r["rss_peak_mib"] - r["rss_before_mib"] for r in rk["runs"][name]) for rk in ranks],
            "rss_before_mib_per_rank": [median(r["rss_before_mib"] for r in rk["runs"][name]) for rk in ranks],
        }
    cases[RESHARD]["median_rank_files_s_per_rank"] = [median(r["rank_files_s"] for r in rk["runs"][RESHARD]) for rk in ranks]
    return {"title": "save at tp=2", "baseline": DCP_DT, "cases": cases, "process_wall_s": res.wall_s,
            "share_bytes_per_rank": [rk["share_bytes"] for rk in ranks], "sha256_s_per_rank": [rk["sha256_s"] for rk in ranks]}


def run_loads(work: Path, *, reps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in LOAD_CASES}
    for r in range(reps + 1):  # round 0: the warm-up
        for name, mode in LOAD_CASES.items():
            out = work / f"{mode}.json"
            run_command(name, [sys.executable, "-m", "bench.checkpoint_worker", mode, str(work), str(out)], env=ENV,
                        cwd=ROOT, timeout=900)
            got = json.loads(out.read_text())
            print(f"  [resume at tp=1] {'warm-up' if not r else f'rep {r}/{reps}':>9} {name:<58} {got['s']:7.3f} s", file=sys.stderr)
            if r:
                runs[name].append(got)
    reshard, dcp_name = list(LOAD_CASES)
    cases = {}
    for name, rs in runs.items():
        cases[name] = {"median_s": median(x["s"] for x in rs), "runs_s": [x["s"] for x in rs],
                       "ratio_to_baseline": median(a["s"] / b["s"] for a, b in zip(rs, runs[dcp_name], strict=True)),
                       "median_build_s": median(x["build_s"] for x in rs) if "build_s" in rs[0] else None,
                       "peak_growth_mib": max(x["rss_peak_mib"] - x["rss_before_mib"] for x in rs),
                       "share_bytes": rs[0]["share_bytes"]}
    agree = all(x["sha256"] == runs[dcp_name][0]["sha256"] for rs in runs.values() for x in rs)
    return {"title": "resume the tp=2 checkpoint at tp=1", "baseline": dcp_name, "cases": cases, "tensors_agree": agree,
            "tensors": len(runs[reshard][0]["sha256"])}


def targets(save: dict[str, Any], load: dict[str, Any]) -> list[dict[str, Any]]:
    s, lc = save["cases"], load["cases"]
    r_dt, r_plain = s[RESHARD]["ratio_to_baseline"], s[RESHARD]["median_s"] / s[DCP_PLAIN]["median_s"]
    r_load = lc[next(iter(LOAD_CASES))]["ratio_to_baseline"]
    growth = max(s[RESHARD]["peak_growth_mib_per_rank"])
    res = lc[next(iter(LOAD_CASES))]
    over = res["peak_growth_mib"] - res["share_bytes"] / MiB
    return [
        {"target": "save at tp=2 vs `dcp.save` (DTensor)", "value": f"{r_dt:.2f}x", "goal": "<= 0.5x", "met": r_dt <= 0.5},
        {"target": "save at tp=2 vs `dcp.save` (plain, per rank)", "value": f"{r_plain:.2f}x", "goal": "<= 0.5x",
         "met": r_plain <= 0.5},
        {"target": "resume at tp=1 vs `dcp.load`", "value": f"{r_load:.2f}x", "goal": "<= 0.5x", "met": r_load <= 0.5},
        {"target": "save: peak RssAnon per rank above its resident state", "value": f"{growth:.0f} MiB",
         "goal": f"<= {RSS_GOAL_MIB} MiB", "met": growth <= RSS_GOAL_MIB},
        {"target": "resume: peak RssAnon growth above its own share", "value": f"{over:+.0f} MiB",
         "goal": f"<= {RSS_GOAL_MIB} MiB", "met": over <= RSS_GOAL_MIB},
        {"target": "resumed tensors equal (reshard vs dcp.load)", "value": str(load["tensors_agree"]), "goal": "True",
         "met": load["tensors_agree"]},
    ]


def markdown(res: dict[str, Any]) -> str:
    save, load, m = res["save"], res["load"], res["meta"]
    shares = save["share_bytes_per_rank"]
    whole = sum(shares) / MiB
    lines = [f"# training checkpoints against torch DCP (`python -m bench.compare_checkpoint --reps {m['reps']}`, "
             f"{m['date']}; llama {m['params'] / 1e6:.0f} M parameters, {m['param_bytes'] / 1e6:.0f} MB in float32, "
             f"{m['steps']} AdamW steps at tp=2; medians of {m['reps']} interleaved rounds after a warm-up; "
             f"{m['machine']})", "",
             f"Each rank's state (parameters + both moments): {', '.join(f'{b / MiB:.0f} MiB' for b in shares)}. "
             "Peak RssAnon growth: this rank's peak during the operation minus its RssAnon just before it.", "",
             "| save at tp=2 (2 gloo ranks) | median s | x dcp.save (DTensor) | blocking s | peak RssAnon growth MiB per rank |",
             "|---|---:|---:|---:|---|"]
    for name, c in save["cases"].items():
        blocking = f"{c['median_blocking_s']:.3f}" if c["median_blocking_s"] is not None else "-"
        lines.append(f"| {name} | {c['median_s']:.3f} | {c['ratio_to_baseline']:.2f}x | {blocking} | "
                     f"{', '.join(f'{g:.0f}' for g in c['peak_growth_mib_per_rank'])} |")
    lines.append(f"| Megatron `fully_reshardable` (described, not run) | - | - | - | gathers every buffer on DP rank 0: "
                 f"~{whole:.0f} MiB of this state there |")
    files, sha = save["cases"][RESHARD]["median_rank_files_s_per_rank"], save["sha256_s_per_rank"]
    lines += ["", f"Where reshard's save time goes, per rank: writing its two rank files (write, sha256, fsync) "
              f"{', '.join(f'{x:.3f}' for x in files)} s, of which sha256 of the share alone takes "
              f"{', '.join(f'{x:.3f}' for x in sha)} s (DCP hashes nothing); the rest is the gathers of the file "
              "digests, trainer_state.json and the rename."]
    lines += ["", "| resume the tp=2 checkpoint at tp=1 (1 process) | median s | x dcp.load | model built + "
              "parameters filled s | peak RssAnon growth MiB (its share) |", "|---|---:|---:|---:|---|"]
    for name, c in load["cases"].items():
        build = f"{c['median_build_s']:.3f}" if c["median_build_s"] is not None else "-"
        lines.append(f"| {name} | {c['median_s']:.3f} | {c['ratio_to_baseline']:.2f}x | {build} | "
                     f"{c['peak_growth_mib']:.0f} ({c['share_bytes'] / MiB:.0f}) |")
    lines += ["", *targets_table(res["targets"])]
    return "\n".join(lines) + "\n"


def run(size: str, reps: int, steps: int, work: Path) -> dict[str, Any]:
    from bench.run import git_state, machine

    src = shards(size)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    save = run_saves(src, work, reps=reps, steps=steps)
    load = run_loads(work, reps=reps)
    cfg = MODELS[size]
    param_bytes = sum(save["share_bytes_per_rank"]) // 3  # parameters + two moments of the same shapes
    meta = {"date": time.strftime("%Y-%m-%d"), "git": git_state(), "machine": machine(), "reps": reps, "steps": steps, "size": size,
            "model": cfg, "param_bytes": param_bytes, "params": param_bytes // 4, "load_at_end": os.getloadavg()[0]}
    return {"meta": meta, "save": save, "load": load, "targets": targets(save, load)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="training steps before the saves (AdamW's moments exist)")
    p.add_argument("--size", choices=sorted(MODELS), default="quick")
    p.add_argument("--out", type=Path, default=RESULTS / "checkpoint.md")
    args = p.parse_args(argv)
    work = data.DATA / "work-checkpoint"
    try:
        res = run(args.size, args.reps, args.steps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_md_json(args.out, markdown(res), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

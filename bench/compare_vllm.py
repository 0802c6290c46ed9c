"""vLLM start-up at tp=2 on the 1 GB checkpoint: the default loader on the full checkpoint vs
`load_format="reshard"` from `reshard serve` and from rank files (`reshard write --engine vllm`),
interleaved rounds (`bench/vllm_worker.py` in the vLLM environment; `./run bench-vllm`).

Time: from launch until `LLM(...)` returns (ready to generate), and the ratio to the default loader
per round. Bytes per rank: the plugin's report of the rank stream it read, the service's count of
shard bytes sent (the two ranks together), and, for the default loader, the bytes vLLM's own weights
iterator hands each rank (every tensor of every file). The greedy tokens of a fixed prompt must agree.
Results: `bench/results/vllm.json` (the table in docs/performance.md is generated from it by
`scripts/gen_docs.py`), with the load average at the start and the end of the run.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.compare_train import bytes_served
from bench.interleave import Case, interleave
from bench.measure import Result, median, run_command
from bench.servers import reshard_serve_argv
from bench.vllm_worker import TP
from reshard.testing.local_servers import free_port, server

NAME = "llama"


def vllm_env(work: Path) -> dict[str, str]:
    for sub in ("tmp", "cache", "rpc"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(work / "tmp"), "VLLM_CACHE_ROOT": str(work / "cache"), "VLLM_RPC_BASE_PATH": str(work / "rpc"),
            "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING"}


def start_case(name: str, mode: str, model_dir: Path, source: str, work: Path, base_url: str | None) -> Case:
    out = work / f"{name}.json"

    def runner(case: Case) -> Result:
        out.unlink(missing_ok=True)
        before = bytes_served(base_url) if base_url else 0.0
        env = {**vllm_env(work), "RESHARD_T0": repr(time.time())}
        res = run_command(case.name, case.argv, env=env, timeout=1800)
        got = json.loads(out.read_text())
        got["served"] = (bytes_served(base_url) - before) if base_url else None
        res.stdout, res.wall_s = json.dumps(got), got["ready_s"]
        return res

    def extra(res: Result) -> dict[str, Any]:
        got = json.loads(res.stdout)
        return {"ready_s": got["ready_s"], "bytes_per_rank": [r["bytes"] for r in got["ranks"]],
                "load_s_per_rank": [r["load_s"] for r in got["ranks"]], "served_by_service": got["served"],
                "tokens": got["tokens"]}

    argv = [sys.executable, "-m", "bench.vllm_worker", mode, str(model_dir), source, str(out)]
    return Case(name, argv, runner=runner, extra=extra, note=f"vLLM tp={TP}: {mode}")


def prepare(src: Path, work: Path) -> tuple[Path, Path, Path]:
    """ROOT/NAME (hard links to the checkpoint), the model= directory without weights, vLLM's rank files."""
    root, meta, shards = work / "root", work / "model", work / "shards"
    (root / NAME).mkdir(parents=True, exist_ok=True)
    meta.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix in (".safetensors", ".json") and p.name != "bench-ckpt.json" and not (root / NAME / p.name).exists():
            (root / NAME / p.name).hardlink_to(p)
        if p.name == "config.json":
            shutil.copy2(p, meta / p.name)
    if not shards.exists():
        subprocess.run([sys.executable, "-m", "reshard.cli", "write", str(root / NAME), "--tp", str(TP), "--engine",
                        "vllm", "-o", str(shards), "--no-progress"], check=True)
    return root, meta, shards


def run_vllm(src: Path, work: Path, *, reps: int) -> dict[str, Any]:
    work = work / "vllm"
    root, meta, shards = prepare(src, work)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(reshard_serve_argv(root, port), f"{base}/healthz", log=work / "serve.log"):
        cases = [start_case("default", "default", root / NAME, str(root / NAME), work, None),
                 start_case("reshard_url", "url", meta, f"{base}/v1/checkpoints/{NAME}", work, base),
                 start_case("reshard_shards", "shards", meta, str(shards), work, None)]
        res = interleave("vLLM start-up tp2", cases, reps=reps, warmup=1, baseline="default")
    runs = {name: c["runs"] for name, c in res["cases"].items()}
    full = sum(p.stat().st_size for p in (root / NAME).glob("*.safetensors"))
    res["summary"] = {name: {"median_ready_s": median([r["ready_s"] for r in rs]),
                             "ready_s": [r["ready_s"] for r in rs],
                             "load_s_per_rank": sorted(s for r in rs for s in r["load_s_per_rank"] if s is not None),
                             "ratio_ready_to_default": res["cases"][name]["ratio_to_baseline"],
                             "bytes_per_rank": rs[-1]["bytes_per_rank"],
                             "bytes_per_rank_fraction_of_checkpoint": [b / full for b in rs[-1]["bytes_per_rank"]],
                             "served_by_service": rs[-1]["served_by_service"]} for name, rs in runs.items()}
    res["tokens_agree"] = len({json.dumps(r["tokens"]) for rs in runs.values() for r in rs}) == 1
    res.update(tp=TP, checkpoint_bytes=full)
    return res


RESULT = Path(__file__).resolve().parent / "results" / "vllm.json"


def save(result: dict[str, Any], *, reps: int, load_at_start: float) -> None:
    """`result` with what was measured and when, as bench/results/vllm.json (one run's runs stripped of samples)."""
    from bench.run import git_state, machine

    for case in result["cases"].values():
        for run in case["runs"]:
            run.pop("samples", None)
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine(), "reps": reps,
            "warmup": 1, "git": git_state(), "load_average": [round(load_at_start, 1), round(os.getloadavg()[0], 1)]}
    RESULT.write_text(json.dumps({"meta": meta, **result}, indent=2, sort_keys=True, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.compare_vllm [REPS]` (in .venv-vllm: `./run bench-vllm`): REPS rounds, 2 by default."""
    from bench import data

    argv = sys.argv[1:] if argv is None else argv
    load_at_start = os.getloadavg()[0]
    reps = int(argv[0]) if argv else 2
    ckpt = data.checkpoint("1gb")
    result = run_vllm(ckpt, data.DATA / "work", reps=reps)
    for name, s in result["summary"].items():
        print(f"{name:<16} ready {s['median_ready_s']:7.1f} s  x{s['ratio_ready_to_default']:.2f} of default  "
              f"bytes/rank {', '.join(f'{b / 1e6:.0f} MB' for b in s['bytes_per_rank'])} "
              f"({', '.join(f'{f:.2f}' for f in s['bytes_per_rank_fraction_of_checkpoint'])} of the checkpoint)")
    print(f"tokens agree: {result['tokens_agree']}")
    save(result, reps=reps, load_at_start=load_at_start)
    print(f"results: {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

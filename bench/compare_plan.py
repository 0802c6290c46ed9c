"""Comparison 5: planning a MoE-sized checkpoint (100,000 tensors, tp=8), and the first byte of a served shard.

`reshard plan --tp 8` on the synthetic checkpoint of `reshard.testing.moe` (64 experts a layer, gate/up
column, down row, 16 files) is run side by side with the floor any planner pays: reading and parsing
the 16 headers (`safetensors.safe_open`, every key, dtype and shape), and with planning a layout beyond
TP, `--tp 8 --ep 8 --pp 2` (16 ranks: each holds half the layers and an eighth of their experts). Then `reshard serve` is started
fresh each round over a root holding the same checkpoint and `curl` asks for rank 0 of tp=8 twice on
one connection: the first answer's time to first byte is the cold one (the worker parses the headers
and plans), the second the warm one (the same worker, its caches filled).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.compare_write import reshard_bin
from bench.interleave import Case, interleave
from bench.measure import median
from bench.servers import reshard_serve_argv
from reshard.testing.local_servers import free_port, server
from reshard.testing.moe import moe_checkpoint

TENSORS, TP = 100_000, 8
HEADERS = """
import sys
from pathlib import Path
from safetensors import safe_open
n = 0
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(f, "np") as h:
        for k in h.keys():
            s = h.get_slice(k)
            n += len(s.get_shape()) + len(s.get_dtype())
print(n)
"""


def first_byte(root: Path, work: Path, url_path: str, reps: int) -> dict[str, Any]:
    """Median time to first byte of a fresh server's first answer (cold) and of its second (warm)."""
    cold, warm = [], []
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    workers = len(os.sched_getaffinity(0))
    for _ in range(reps):
        port = free_port()
        with server(reshard_serve_argv(root, port, workers=workers), f"http://127.0.0.1:{port}/healthz",
                    log=logs / "plan-serve.log"):
            url = f"http://127.0.0.1:{port}{url_path}"
            out = subprocess.run(["curl", "-sS", "-f", "-o", "/dev/null", "-o", "/dev/null", "-w",
                                  "%{time_starttransfer}\\n", url, url], check=True, capture_output=True, text=True)
            a, b = (float(x) for x in out.stdout.split())
            cold.append(a)
            warm.append(b)
    return {"cold_s": median(cold), "warm_s": median(warm), "cold_runs": cold, "warm_runs": warm, "workers": workers}


def run_plan(data_root: Path, work: Path, *, reps: int) -> list[dict[str, Any]]:
    ckpt = moe_checkpoint(data_root / "moe-100k", tensors=TENSORS)
    cases = [
        Case("read the headers (safe_open)", [sys.executable, "-c", HEADERS, str(ckpt)], note="16 files"),
        Case(f"reshard plan --tp {TP}", [reshard_bin(), "plan", str(ckpt), "--tp", str(TP)],
             note=f"{TENSORS} tensors x {TP} ranks"),
        Case(f"reshard plan --tp {TP} --ep {TP} --pp 2", [reshard_bin(), "plan", str(ckpt), "--tp", str(TP), "--ep",
                                                          str(TP), "--pp", "2"], note=f"{2 * TP} ranks: a layout"),
    ]
    res = interleave(f"plan {TENSORS} tensors tp{TP}", cases, reps=reps, baseline=cases[0].name)
    plan = res["cases"][cases[1].name]
    plan["us_per_tensor_rank"] = plan["median_s"] / (TENSORS * TP) * 1e6
    root = work / "plan-root"
    (root / "moe").mkdir(parents=True, exist_ok=True)
    for p in ckpt.iterdir():
        if not (root / "moe" / p.name).exists():
            os.link(p, root / "moe" / p.name)
    res["first_byte"] = first_byte(root, work, f"/v1/checkpoints/moe/shards/0?tp={TP}", reps)
    res.update(tensors=TENSORS, tp=TP)
    return [res]

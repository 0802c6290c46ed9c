"""`python -m bench.serve_options [--reps 5]`: the service's data-path options side by side with nginx.

One client pulls rank 0 of tp=4 (a column-split and a row-split variant of the 1 GB checkpoint) from
nginx and from `reshard serve` as it ships (zero-copy send, copies of gathered pieces, mapped row
gathers, 8 MiB chunks), with each of those turned off or changed (`RESHARD_GATHER_CACHE=0`,
`RESHARD_ZERO_COPY=false`, `RESHARD_MAPPED_READS=false`, 4, 16 and 1 MiB chunks; those variants all
gather every pull), and from the same app under granian when `granian` is importable (it is not a
dependency: `pip install granian` or put it on PYTHONPATH). Every server runs one worker per core.
Prints, per variant and option, the throughput relative to nginx (median of per-round ratios), the
median MB/s and the server's peak RssAnon.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from bench import data
from bench.compare_serve import TP, WORKERS, _check, curl, prepare
from bench.interleave import Case, interleave
from bench.measure import median
from bench.servers import REPO, ensure_nginx, nginx_argv, reshard_serve_argv
from reshard.testing.local_servers import free_port, server

NO_COPIES = {"RESHARD_GATHER_CACHE": "0"}
OPTIONS = {  # name -> the server's environment; all but the first gather every pull (the copies of
    # gathered pieces would otherwise stand in for the row path each option changes)
    "reshard serve (sendfile, copies of gathered pieces, mapped gathers, 8 MiB chunks)": {},
    "no copies of gathered pieces (gather every pull)": NO_COPIES,
    "no zero-copy send": {**NO_COPIES, "RESHARD_ZERO_COPY": "false"},
    "no mapped gathers (pread row blocks)": {**NO_COPIES, "RESHARD_MAPPED_READS": "false"},
    "4 MiB chunks": {**NO_COPIES, "RESHARD_CHUNK_SIZE": str(4 << 20)},
    "16 MiB chunks": {**NO_COPIES, "RESHARD_CHUNK_SIZE": str(16 << 20)},
    "1 MiB chunks": {**NO_COPIES, "RESHARD_CHUNK_SIZE": str(1 << 20)},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_options", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--data", type=Path, default=data.DATA)
    args = p.parse_args(argv)
    work = args.data / "work-options"
    root, files = prepare(data.checkpoint("1gb", root=args.data), work, ["col", "row"])
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = ["nginx", *OPTIONS] + (["granian (the same app)"] if importlib.util.find_spec("granian") else [])
    ports = {n: free_port() for n in names}
    results: dict[str, dict[str, object]] = {}
    with contextlib.ExitStack() as stack:
        pids = {"nginx": stack.enter_context(server(
            nginx_argv(ensure_nginx(), files, work / "nginx", ports["nginx"], workers=WORKERS),
            f"http://127.0.0.1:{ports['nginx']}/", log=logs / "nginx.log")).pid}
        for i, (n, env) in enumerate(OPTIONS.items()):
            pids[n] = stack.enter_context(server(
                reshard_serve_argv(root, ports[n], workers=WORKERS), f"http://127.0.0.1:{ports[n]}/healthz",
                env=env, log=logs / f"option-{i}.log")).pid
        if "granian (the same app)" in ports:
            n = "granian (the same app)"
            argv_g = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--workers", str(WORKERS),
                      "--host", "127.0.0.1", "--port", str(ports[n]), "--no-ws", "--log-level", "warning",
                      "reshard.service.process.workers:worker_app"]
            env = {"RESHARD_ROOT": str(root), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            pids[n] = stack.enter_context(server(argv_g, f"http://127.0.0.1:{ports[n]}/healthz", env=env,
                                                 log=logs / "granian.log")).pid
        for variant in ("col", "row"):
            rel = f"{variant}/tp{TP}/rank-00000-of-{TP:05d}.safetensors"
            expected = (files / rel).stat().st_size
            urls = {n: f"http://127.0.0.1:{ports[n]}/v1/checkpoints/{variant}/shards/0?tp={TP}" for n in names[1:]}
            urls = {"nginx": f"http://127.0.0.1:{ports['nginx']}/{rel}", **urls}
            cases = [Case(n, curl(u), watch=lambda pid=pids[n]: {"server": pid}, extra=_check(expected))
                     for n, u in urls.items()]
            res = interleave(f"{variant} rank, 1 client", cases, reps=args.reps, baseline="nginx",
                             warmup=max(WORKERS, 2))  # a round per worker (caches, mappings); two make copies
            results[variant] = {
                n: {"throughput_vs_nginx": round(1 / c["ratio_to_baseline"], 2),
                    "median_mb_s": round(median(r["mb_s"] for r in c["runs"])),
                    "server_peak_rss_anon_mib": round(c.get("watched_peak_rss_anon_mib", {}).get("server", 0))}
                for n, c in res["cases"].items()}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

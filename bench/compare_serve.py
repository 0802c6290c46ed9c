"""Comparison 3: pulling rank shards from `reshard serve` vs nginx (sendfile) vs FastAPI `FileResponse`.

The service computes each shard on the fly from the full checkpoint; nginx and FileResponse serve the
same bytes pre-written by `reshard write`. Two manifests make the two access patterns: every matrix
`column`-split (a rank's bytes are contiguous runs of the source) or every matrix `row`-split (runs
of one row's slice, strided); the default (Llama) plan mixes both. The concurrent cases pull mixed
ranks of two tps (4 and 2) at once. `reshard serve` and nginx run as many worker processes as there
are cores (`--workers`, `worker_processes`); FileResponse is one uvicorn process. The client is
`curl -o /dev/null`; its wall time is measured and the servers' process trees are sampled for RssAnon
alongside (the server's base before the run and its peak are both recorded, so the memory per open
stream can be read off). Servers start before and stop after each comparison (outside the timings);
the warm-up rounds (one per worker, at least two) also fill the service's plan caches and file
mappings, and make its copies of gathered (row-split) pieces (`reshard.service.transport.gathered`: the second whole
pull of a shard writes them; they are deleted before the comparisons). "reshard serve, gathering every
pull" is the same server with those copies off (`RESHARD_GATHER_CACHE=0`): the speed of a shard's
first pulls.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.compare_write import reshard_bin
from bench.interleave import Case, MiB, interleave
from bench.measure import Result, median
from bench.servers import ensure_nginx, fileserver_argv, nginx_argv, reshard_serve_argv
from reshard.testing.local_servers import free_port, server

TP = 4
TPS = (4, 2)  # the concurrent cases mix ranks of both
MATRIX = ("*_proj.weight", "*embed_tokens.weight", "lm_head.weight")
WORKERS = len(os.sched_getaffinity(0))


KINDS = {"col": "column", "row": "row", "default": None}


def prepare(src: Path, work: Path, variants: list[str]) -> tuple[Path, Path]:
    """A serve root with checkpoints `variants` (hard links to `src` + a rules file) and no copies of
    gathered pieces from an earlier run, and their tp=4 files."""
    root, files = work / "serve-root", work / "serve-files"
    shutil.rmtree(root / ".reshard" / "gathered", ignore_errors=True)
    for variant in variants:
        kind = KINDS[variant]
        d = root / variant
        d.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            if p.suffix in (".safetensors", ".json") and p.name != "bench-ckpt.json" and not (d / p.name).exists():
                os.link(p, d / p.name)
        if kind:
            rules = {"rules": [{"pattern": pat, "kind": kind} for pat in MATRIX]}
            (d / "reshard-rules.json").write_text(json.dumps(rules))
        for tp in TPS if variant == "default" else (TP,):
            out = files / variant / f"tp{tp}"
            if not (out / "reshard.json").exists():  # a run killed mid-write leaves no record: redo it
                subprocess.run([reshard_bin(), "write", str(d), "--tp", str(tp), "-o", str(out), "--no-progress"],
                               check=True, stdout=subprocess.DEVNULL)
    return root, files


def curl(url: str) -> list[str]:
    return ["curl", "-sS", "-f", "-o", "/dev/null", "-w", "%{http_code} %{size_download}\\n", url]


def curl_many(urls: list[str]) -> list[str]:
    """Several concurrent curls in one command; fails if any fails; prints one line per transfer."""
    script = 'pids=""; for u in "$@"; do curl -sS -f -o /dev/null -w "%{http_code} %{size_download}\\n" "$u" & ' \
             'pids="$pids $!"; done; rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc'
    return ["sh", "-c", script, "curl_many", *urls]


def _check(expected: int) -> Callable[[Result], dict[str, Any]]:
    def extra(res: Result) -> dict[str, Any]:
        lines = [ln.split() for ln in res.stdout.strip().splitlines()]
        got = sum(int(x[1]) for x in lines)
        if any(x[0] not in ("200", "206") for x in lines) or got != expected:
            raise RuntimeError(f"{res.name}: received {got} bytes ({res.stdout.strip()!r}), expected {expected}")
        return {"bytes": got, "mb_s": got / res.wall_s / 1e6}

    return extra


@contextlib.contextmanager
def serve_servers(root: Path, files: Path, work: Path) -> Iterator[dict[str, Any]]:
    nginx = ensure_nginx()
    ports = {k: free_port() for k in ("reshard", "gathering", "nginx", "fileresponse")}
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with server(reshard_serve_argv(root, ports["reshard"], workers=WORKERS),
                f"http://127.0.0.1:{ports['reshard']}/healthz", log=logs / "reshard-serve.log") as rs, \
            server(reshard_serve_argv(root, ports["gathering"], workers=WORKERS),
                   f"http://127.0.0.1:{ports['gathering']}/healthz", env={"RESHARD_GATHER_CACHE": "0"},
                   log=logs / "reshard-serve-gathering.log") as rg, \
            server(nginx_argv(nginx, files, work / "nginx", ports["nginx"], workers=WORKERS),
                   f"http://127.0.0.1:{ports['nginx']}/", log=logs / "nginx.log") as ng, \
            server(fileserver_argv(files, ports["fileresponse"]), f"http://127.0.0.1:{ports['fileresponse']}/healthz",
                   log=logs / "fileresponse.log") as fr:
        yield {"ports": ports, "pids": {"reshard": rs.pid, "gathering": rg.pid, "nginx": ng.pid, "fileresponse": fr.pid}}


def serve_cases(srv: dict[str, Any], files: Path, variant: str, pulls: list[tuple[int, int]]) -> list[Case]:
    """Cases pulling `pulls` ((tp, rank) pairs) of `variant` at once from each server."""
    ports, pids = srv["ports"], srv["pids"]
    names = [f"{variant}/tp{tp}/rank-{r:05d}-of-{tp:05d}.safetensors" for tp, r in pulls]
    expected = sum((files / n).stat().st_size for n in names)
    urls = {
        "nginx": [f"http://127.0.0.1:{ports['nginx']}/{n}" for n in names],
        "reshard serve": [f"http://127.0.0.1:{ports['reshard']}/v1/checkpoints/{variant}/shards/{r}?tp={tp}"
                          for tp, r in pulls],
        "reshard serve, gathering every pull": [
            f"http://127.0.0.1:{ports['gathering']}/v1/checkpoints/{variant}/shards/{r}?tp={tp}" for tp, r in pulls],
        "FastAPI FileResponse": [f"http://127.0.0.1:{ports['fileresponse']}/files/{n}" for n in names],
    }
    key = {"nginx": "nginx", "reshard serve": "reshard", "reshard serve, gathering every pull": "gathering",
           "FastAPI FileResponse": "fileresponse"}
    cases = []
    for name, us in urls.items():
        pid = pids[key[name]]
        cases.append(Case(name, curl(us[0]) if len(us) == 1 else curl_many(us), watch=lambda pid=pid: {"server": pid},
                          extra=_check(expected), note=f"{len(us)} client(s), {expected / 1e6:.0f} MB"))
    return cases


def _mixed(n: int) -> list[tuple[int, int]]:
    """n pulls cycling over every rank of tp=4 and tp=2."""
    every = [(tp, r) for tp in TPS for r in range(tp)]
    return [every[i % len(every)] for i in range(n)]


def run_serve(src: Path, work: Path, *, full: bool, reps: int) -> list[dict[str, Any]]:
    runs = [("serve 1 client, column rank", "col", [(TP, 0)])]
    if full:
        runs += [("serve 1 client, row rank", "row", [(TP, 0)]),
                 ("serve 4 clients, mixed ranks of tp 4 and 2", "default", _mixed(4)),
                 ("serve 16 clients, mixed ranks of tp 4 and 2", "default", _mixed(16))]
    root, files = prepare(src, work, sorted({v for _, v, _ in runs}))
    results = []
    with serve_servers(root, files, work) as srv:
        for title, variant, pulls in runs:
            cases = serve_cases(srv, files, variant, pulls)
            # single transfers take a fraction of a second: more rounds for the same noise
            res = interleave(title, cases, reps=reps if len(pulls) > 1 else max(reps, 7), baseline="nginx",
                             warmup=max(WORKERS, 2))  # a round per worker (caches, mappings); two make copies
            for name, c in res["cases"].items():
                c["median_mb_s"] = median(r["mb_s"] for r in c["runs"])
                c["note"] = next(x.note for x in cases if x.name == name)
                base = [r.get("watched_base_rss_anon_bytes", {}).get("server") for r in c["runs"]]
                peak = [r.get("watched_peak_rss_anon_bytes", {}).get("server") for r in c["runs"]]
                if all(b is not None for b in base) and all(p is not None for p in peak):
                    c["server_base_rss_anon_mib"] = min(base) / MiB
                    c["server_growth_per_stream_mib"] = max(p - b for p, b in zip(peak, base)) / MiB / len(pulls)
            res.update(variant=variant, pulls=pulls, tp=TP, workers=WORKERS)
            results.append(res)
    return results

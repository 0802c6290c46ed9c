"""Comparison 3: pulling rank shards from `reshard serve` vs nginx (sendfile) vs FastAPI `FileResponse`.

The service computes each shard on the fly from the full checkpoint; nginx and FileResponse serve the
same bytes pre-written by `reshard write`. Two manifests make the two access patterns: every matrix
`column`-split (a rank's bytes are contiguous runs of the source) or every matrix `row`-split (runs
of one row's slice, strided). The client is `curl -o /dev/null`; its wall time is measured and the
servers' process trees are sampled for RssAnon alongside. Servers start before and stop after each
comparison (outside the timings); the warm-up round also fills the service's plan cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.compare_write import reshard_bin
from bench.interleave import Case, interleave
from bench.measure import Result, median
from bench.servers import (
    ensure_nginx,
    fileserver_argv,
    free_port,
    nginx_argv,
    reshard_serve_argv,
    server,
)

TP = 4
MATRIX = ("*_proj.weight", "*embed_tokens.weight", "lm_head.weight")


KINDS = {"col": "column", "row": "row", "default": None}


def prepare(src: Path, work: Path, variants: list[str]) -> tuple[Path, Path]:
    """A serve root with checkpoints `variants` (hard links to `src` + a rules file), and their tp=4 files."""
    root, files = work / "serve-root", work / "serve-files"
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
        out = files / variant
        if not (out / "reshard.json").exists():  # a run killed mid-write leaves no record: redo it
            subprocess.run([reshard_bin(), "write", str(d), "--tp", str(TP), "-o", str(out), "--no-progress"],
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
def three_servers(root: Path, files: Path, work: Path) -> Iterator[dict[str, Any]]:
    nginx = ensure_nginx()
    ports = {k: free_port() for k in ("reshard", "nginx", "fileresponse")}
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with server(reshard_serve_argv(root, ports["reshard"]), f"http://127.0.0.1:{ports['reshard']}/healthz",
                log=logs / "reshard-serve.log") as rs, \
            server(nginx_argv(nginx, files, work / "nginx", ports["nginx"]), f"http://127.0.0.1:{ports['nginx']}/",
                   log=logs / "nginx.log") as ng, \
            server(fileserver_argv(ports["fileresponse"]), f"http://127.0.0.1:{ports['fileresponse']}/healthz",
                   env={"BENCH_FILE_ROOT": str(files)}, log=logs / "fileresponse.log") as fr:
        yield {"ports": ports, "pids": {"reshard": rs.pid, "nginx": ng.pid, "fileresponse": fr.pid}}


def serve_cases(srv: dict[str, Any], files: Path, variant: str, ranks: list[int]) -> list[Case]:
    ports, pids = srv["ports"], srv["pids"]
    names = [f"rank-{r:05d}-of-{TP:05d}.safetensors" for r in ranks]
    expected = sum((files / variant / n).stat().st_size for n in names)
    urls = {
        "nginx": [f"http://127.0.0.1:{ports['nginx']}/{variant}/{n}" for n in names],
        "reshard serve": [f"http://127.0.0.1:{ports['reshard']}/v1/checkpoints/{variant}/shards/{r}?tp={TP}"
                          for r in ranks],
        "FastAPI FileResponse": [f"http://127.0.0.1:{ports['fileresponse']}/files/{variant}/{n}" for n in names],
    }
    key = {"nginx": "nginx", "reshard serve": "reshard", "FastAPI FileResponse": "fileresponse"}
    cases = []
    for name, us in urls.items():
        pid = pids[key[name]]
        cases.append(Case(name, curl(us[0]) if len(us) == 1 else curl_many(us), watch=lambda pid=pid: {"server": pid},
                          extra=_check(expected), note=f"{len(us)} client(s), {expected / 1e6:.0f} MB"))
    return cases


def run_serve(src: Path, work: Path, *, full: bool, reps: int) -> list[dict[str, Any]]:
    runs = [("serve 1 client, column rank", "col", [0])]
    if full:
        runs += [("serve 1 client, row rank", "row", [0]), ("serve 4 clients, 4 ranks (llama plan)", "default", [0, 1, 2, 3])]
    root, files = prepare(src, work, sorted({v for _, v, _ in runs}))
    results = []
    with three_servers(root, files, work) as srv:
        for title, variant, ranks in runs:
            cases = serve_cases(srv, files, variant, ranks)
            # single transfers take a fraction of a second: more rounds for the same noise
            res = interleave(title, cases, reps=reps if len(ranks) > 1 else max(reps, 7), baseline="nginx")
            for name, c in res["cases"].items():
                c["median_mb_s"] = median(r["mb_s"] for r in c["runs"])
                c["note"] = next(x.note for x in cases if x.name == name)
            res.update(variant=variant, ranks=ranks, tp=TP)
            results.append(res)
    return results

"""One node, one rank, straight from a store: `reshard write URL --tp 8 --ranks 3` of the 1 GB checkpoint,
each way of fetching a row-split tensor's rows, from each kind of store (interleaved).

    python -m bench.compare_direct [--reps 3] [--tp 8] [--rank 3] [--slices-s3-timeout 120]

Stores, each on 127.0.0.1 and counting the body bytes and requests it answers:
  s3      moto's S3 server (one range per request)
  http    reshard.testing.fileserver (Starlette FileResponse: several ranges per request, at most 100, each part
          read by a thread hop)
  nginx   nginx 1.22 (several ranges per request, parts written by C), counted from its access log
Ways (`RESHARD_STORE_ROWS`): `auto` (the default: whichever reshard.io.source.readcost prices lower, from the
costs the process measures), `blocks` (the row blocks), `slices` (each row's slice: several per request
where the server answers them); `auto, 1 Gbit/s` is `auto` told the node's link rate
(`RESHARD_STORE_BANDWIDTH=125000000`), which loopback cannot show. S3 slices (a GET per row: tens of
thousands) run once, after the rounds, cut at `--slices-s3-timeout` seconds.

Every output is compared with the rank file written from the local checkpoint. Writes
`bench/results/direct_reads.{md,json}`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import data
from bench.compare_write import reshard_bin
from bench.interleave import Case, interleave
from bench.measure import Result, median
from bench.report import targets_table, write_md_json
from bench.servers import ensure_nginx
from reshard.testing.local_servers import free_port, http_server, s3_server, server

RESULTS = Path(__file__).resolve().parent / "results"
NAME, BUCKET = "llama", "bench"
WAYS = {"auto": {}, "blocks": {"RESHARD_STORE_ROWS": "blocks"}, "slices": {"RESHARD_STORE_ROWS": "slices"},
        "auto, 1 Gbit/s": {"RESHARD_STORE_BANDWIDTH": "125000000"}}
NGINX_CONF = """daemon off; master_process on; worker_processes 2; user root; pid {work}/nginx.pid;
error_log {work}/error.log warn; events {{ worker_connections 256; }}
http {{ log_format counts '$uri $status $body_bytes_sent'; access_log {work}/access.log counts;
  sendfile on; keepalive_timeout 30; client_body_temp_path {work}/tmp; proxy_temp_path {work}/tmp;
  fastcgi_temp_path {work}/tmp; uwsgi_temp_path {work}/tmp; scgi_temp_path {work}/tmp;
  default_type application/octet-stream;
  server {{ listen 127.0.0.1:{port}; location /files/ {{ alias {root}/; }} location /healthz {{ return 200; }} }} }}
"""


class Nginx:
    """nginx over `root` at /files/, its requests and body bytes counted from the access log."""

    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log, self.env = url, log, {}

    def counts(self) -> dict[str, int]:
        lines = self.log.read_text().split("\n") if self.log.exists() else []
        sent = [int(ln.split()[2]) for ln in lines if ln.startswith("/files/")]  # not /healthz
        return {"bytes": sum(sent), "requests": len(sent)}

    def reset(self) -> dict[str, int]:
        out = self.counts()
        if self.log.exists():
            os.truncate(self.log, 0)  # nginx appends (O_APPEND): its next line lands at the new end
        return out


@contextlib.contextmanager
def nginx_server(root: Path, work: Path) -> Iterator[Nginx]:
    nginx, port = ensure_nginx(), free_port()
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    conf = work / "nginx.conf"
    conf.write_text(NGINX_CONF.format(work=work.resolve(), port=port, root=root.resolve()))
    url = f"http://127.0.0.1:{port}"
    with server([nginx, "-p", str(work), "-c", str(conf)], url + "/healthz", log=work / "stderr.log"):
        yield Nginx(url, work / "access.log")


@contextlib.contextmanager
def stores(root: Path, work: Path) -> Iterator[dict[str, tuple[Any, str]]]:
    """{kind: (server, checkpoint URL)}: the checkpoint under `root`/NAME in each store."""
    import boto3

    with s3_server() as s3, http_server(root) as web, nginx_server(root, work / "nginx") as ngx:
        env = s3.env
        client = boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])
        client.create_bucket(Bucket=BUCKET)
        for p in sorted((root / NAME).iterdir()):
            client.upload_file(str(p), BUCKET, f"{NAME}/{p.name}")
        yield {"s3": (s3, f"s3://{BUCKET}/{NAME}"), "http": (web, f"{web.url}/files/{NAME}/"),
               "nginx": (ngx, f"{ngx.url}/files/{NAME}/")}


def _argv(url: str, out: Path, tp: int, rank: int) -> list[str]:
    return [reshard_bin(), "write", url, "--tp", str(tp), "--ranks", str(rank), "-o", str(out), "--no-progress"]


def _case(kind: str, way: str, srv: Any, url: str, out: Path, want: bytes, tp: int, rank: int) -> Case:
    target = out / f"rank-{rank:05d}-of-{tp:05d}.safetensors"

    def setup() -> None:
        shutil.rmtree(out, ignore_errors=True)
        srv.reset()

    def extra(res: Result) -> dict[str, Any]:
        counts = srv.reset()
        return {"store_bytes": counts["bytes"], "requests": counts["requests"],
                "same": target.is_file() and target.read_bytes() == want}

    env = {**srv.env, "NO_PROXY": "127.0.0.1,localhost", **WAYS[way]}
    return Case(f"{kind}, {way}", _argv(url, out, tp, rank), env=env, setup=setup, extra=extra,
                teardown=lambda: shutil.rmtree(out, ignore_errors=True))


def _rows(src: Path, tp: int, rank: int) -> int:
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    ckpt, manifest = open_source(src)
    rp = make_plan(ckpt, manifest, tp, ranks=[rank]).ranks[0]
    return sum(s.count for t in rp.tensors for s in t.segments if s.file and not s.contiguous)


def run(reps: int, tp: int, rank: int, work: Path, slices_s3_timeout: float) -> dict[str, Any]:
    src = data.checkpoint("1gb")
    root = work / "root"
    (root / NAME).mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != data.STAMP and not (root / NAME / p.name).exists():
            os.link(p, root / NAME / p.name)
    subprocess.run(_argv(str(src), work / "local", tp, rank), check=True, stdout=subprocess.DEVNULL)
    want = (work / "local" / f"rank-{rank:05d}-of-{tp:05d}.safetensors").read_bytes()
    with stores(root, work) as kinds:
        cases = [_case(kind, way, srv, url, work / "out", want, tp, rank) for kind, (srv, url) in kinds.items()
                 for way in WAYS if (kind, way) != ("s3", "slices")]
        res = interleave(f"direct reads tp{tp} rank {rank}", cases, reps=reps, warmup=1, baseline="s3, auto")
        res["s3_slices"] = _slices_s3(kinds["s3"], work / "out", want, tp, rank, slices_s3_timeout)
    res.update(tp=tp, rank=rank, shard=len(want), rows=_rows(src, tp, rank), load=os.getloadavg()[0])
    for c in res["cases"].values():
        for k in ("store_bytes", "requests"):
            c[f"median_{k}"] = median(r[k] for r in c["runs"])
        c["same"] = all(r["same"] for r in c["runs"])
    return res


def _slices_s3(s3: tuple[Any, str], out: Path, want: bytes, tp: int, rank: int, timeout: float) -> dict[str, Any]:
    """S3, a GET per row: once, cut at `timeout` seconds (what the store answered by then)."""
    import time

    srv, url = s3
    shutil.rmtree(out, ignore_errors=True)
    srv.reset()
    t0 = time.perf_counter()
    try:
        subprocess.run(_argv(url, out, tp, rank), env={**os.environ, **srv.env, **WAYS["slices"]}, timeout=timeout,
                       check=True, stdout=subprocess.DEVNULL)
        done = True
    except subprocess.TimeoutExpired:
        done = False
    counts = srv.reset()
    target = out / f"rank-{rank:05d}-of-{tp:05d}.safetensors"
    same = done and target.read_bytes() == want
    shutil.rmtree(out, ignore_errors=True)
    return {"done": done, "s": time.perf_counter() - t0, "store_bytes": counts["bytes"], "requests": counts["requests"],
            "same": same}


def markdown(res: dict[str, Any], reps: int) -> str:
    from bench.targets import direct_targets

    shard = res["shard"]
    lines = [f"# one rank of tp={res['tp']} (rank {res['rank']}) written straight from each store "
             f"(python -m bench.compare_direct --reps {reps}; 1 GB checkpoint, medians of {reps} interleaved rounds "
             "after a warm-up)", "",
             f"the rank's shard: {shard / 2**20:.1f} MiB, {res['rows']} rows of row-split tensors; load average "
             f"{res['load']:.1f} at the end (shared 2-core VM)", "",
             "| store, way | median s | MiB from the store | x shard | requests | bytes equal |", "|---|---|---|---|---|---|"]
    for name, c in res["cases"].items():
        lines.append(f"| {name} | {c['median_s']:.2f} | {c['median_store_bytes'] / 2**20:.1f} | "
                     f"{c['median_store_bytes'] / shard:.2f} | {c['median_requests']:.0f} | {'yes' if c['same'] else '**no**'} |")
    s = res["s3_slices"]
    lines.append(f"| s3, slices (once) | {'' if s['done'] else '> '}{s['s']:.0f} | {s['store_bytes'] / 2**20:.1f} | "
                 f"{s['store_bytes'] / shard:.2f}{'' if s['done'] else ' so far'} | {s['requests']}"
                 f"{'' if s['done'] else ' so far'} | {'yes' if s['same'] else '-' if not s['done'] else '**no**'} |")
    lines += ["", *targets_table(direct_targets(res))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_direct", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--slices-s3-timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=RESULTS / "direct_reads.md")
    args = p.parse_args(argv)
    work = data.DATA / "work-direct"
    try:
        res = run(args.reps, args.tp, args.rank, work, args.slices_s3_timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_md_json(args.out, markdown(res, args.reps), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

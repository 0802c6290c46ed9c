"""Which S3 client reshard reads with: obstore vs fsspec/s3fs vs boto3, side by side on the local moto server.

    python -m bench.compare_stores [--reps 3] [--mib 64]

Two workloads on one object, each the shape of a rank's reads: `strided` (the runs of a row-split
tensor at tp=2: 16 KiB taken, 16 KiB skipped, as separate ranged GETs) and `blocks` (1 MiB column-split
blocks). Each client runs in its own process (wall time includes its import and its client set-up,
the fetch time is printed separately) with 8 requests in flight:
  obstore-threads  obstore.get_range from 8 threads (what reshard.io.source.stores does)
  obstore-ranges   obstore.get_ranges (its own concurrency; coalescing off: the gaps must not be fetched)
  s3fs             fsspec's s3fs `cat_ranges` (aiobotocore; it does not coalesce)
  boto3-threads    boto3 get_object(Range=...) from 8 threads
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.interleave import Case, interleave
from bench.measure import Result

BUCKET, KEY = "bench", "blob.bin"
CLIENTS = ("obstore-threads", "obstore-ranges", "s3fs", "boto3-threads")
THREADS = 8


def ranges(workload: str, size: int) -> list[tuple[int, int]]:
    if workload == "strided":
        run = 16 << 10
        return [(o, o + run) for o in range(0, size - run + 1, 2 * run)]
    block = 1 << 20
    return [(o, min(o + block, size)) for o in range(0, size, block)]


def fetch(client: str, rs: list[tuple[int, int]]) -> int:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    if client.startswith("obstore"):
        import obstore
        from obstore.store import S3Store

        store = S3Store(BUCKET, client_options={"allow_http": True})
        if client == "obstore-ranges":
            out = obstore.get_ranges(store, KEY, starts=[a for a, _ in rs], ends=[b for _, b in rs], coalesce=0)
            return sum(len(memoryview(b)) for b in out)
        with ThreadPoolExecutor(THREADS) as pool:
            return sum(pool.map(lambda r: len(memoryview(obstore.get_range(store, KEY, start=r[0], end=r[1]))), rs))
    if client == "s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint, max_concurrency=THREADS)
        path = f"{BUCKET}/{KEY}"
        out = fs.cat_ranges([path] * len(rs), [a for a, _ in rs], [b for _, b in rs], batch_size=THREADS)
        return sum(len(b) for b in out)
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)

    def one(r: tuple[int, int]) -> int:
        return len(s3.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={r[0]}-{r[1] - 1}")["Body"].read())

    with ThreadPoolExecutor(THREADS) as pool:
        return sum(pool.map(one, rs))


def child(client: str, workload: str, size: int) -> None:
    rs = ranges(workload, size)
    t0 = time.perf_counter()
    got = fetch(client, rs)
    assert got == sum(b - a for a, b in rs), (client, got)
    print(json.dumps({"fetch_s": time.perf_counter() - t0, "bytes": got, "requests": len(rs)}))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.compare_stores", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--child", nargs=3, metavar=("CLIENT", "WORKLOAD", "SIZE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return {}
    import boto3

    from reshard.testing.local_servers import s3_server

    size = args.mib << 20
    results: dict[str, Any] = {}
    with s3_server() as s3:
        os.environ.update(s3.env)
        boto = boto3.client("s3", endpoint_url=s3.url)
        boto.create_bucket(Bucket=BUCKET)
        boto.put_object(Bucket=BUCKET, Key=KEY, Body=os.urandom(size))
        for workload in ("strided", "blocks"):
            def extra(res: Result) -> dict[str, Any]:
                return json.loads(res.stdout.strip().splitlines()[-1])

            cases = [Case(c, [sys.executable, "-m", "bench.compare_stores", "--child", c, workload, str(size)],
                          env=s3.env, extra=extra) for c in CLIENTS]
            results[workload] = interleave(f"stores {workload}", cases, reps=args.reps)
    print(table(results))
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| workload | client | fetch s (median) | wall s (median) | ratio to obstore-threads | peak RssAnon MiB |",
             "|---|---|---|---|---|---|"]
    for workload, res in results.items():
        for name, c in res["cases"].items():
            fetch_s = sorted(r["fetch_s"] for r in c["runs"])[len(c["runs"]) // 2]
            lines.append(f"| {workload} | {name} | {fetch_s:.3f} | {c['median_s']:.3f} | "
                         f"{c['ratio_to_baseline']:.2f} | {c['median_peak_rss_anon_mib']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

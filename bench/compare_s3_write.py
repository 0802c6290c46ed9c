"""`reshard write s3://... --tp 4` against downloading the whole checkpoint first, on the local moto server.

    python -m bench.compare_s3_write [--reps 3] [--warmup 1] [--layers 2]

  ranged          reshard write s3://bench/ckpt --tp 4 -o OUT   (ranged GETs of what each rank reads:
                  contiguous slices, row-split tensors as row blocks)
  ranged-blocks   the same with RESHARD_STORE_WASTE=10 RESHARD_STORE_MAX_GAP=1MiB: neighbouring ranges
                  merged across larger gaps too (fewer requests, more bytes)
  ranged-rank0    reshard write ... --ranks 0: what one node of a tp=4 job fetches
  download        obstore GETs every object to a local directory, then reshard write DIR --tp 4 -o OUT
Both use obstore (the library reshard reads with); each run is one process, timed from spawn to exit,
with its peak RssAnon; the server counts the body bytes it served during the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.interleave import Case, interleave
from bench.measure import Result

BUCKET = "bench"


def download_then_write(url: str, work: Path, out: Path) -> None:
    import obstore

    from reshard.cli import main
    from reshard.io.source.stores import store_for

    store, prefix = store_for(url.rstrip("/") + "/")
    local = work / "download"
    local.mkdir(parents=True, exist_ok=True)
    _, files = store.list(prefix)
    for name in files:
        with open(local / name, "wb") as f:
            for chunk in obstore.get(store._store, f"{prefix.rstrip('/')}/{name}").stream(min_chunk_size=8 << 20):
                f.write(chunk)
    assert main(["write", str(local), "--tp", "4", "-o", str(out), "--no-progress"]) == 0
    shutil.rmtree(local)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.compare_s3_write", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--child-download", nargs=3, metavar=("URL", "WORK", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_download:
        download_then_write(args.child_download[0], Path(args.child_download[1]), Path(args.child_download[2]))
        return {}
    import boto3

    from reshard.testing.local_servers import s3_server
    from reshard.testing.synth import llama_config, make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    src = make_checkpoint(work / "ckpt", llama_config(hidden_size=512, intermediate_size=1024, vocab_size=4000,
                                                      num_hidden_layers=args.layers, num_attention_heads=8,
                                                      num_key_value_heads=8), num_files=4)
    total = sum(f.stat().st_size for f in src.iterdir())
    try:
        with s3_server() as s3:
            boto = boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
                                aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
            boto.create_bucket(Bucket=BUCKET)
            for f in sorted(src.iterdir()):
                boto.upload_file(str(f), BUCKET, f"ckpt/{f.name}")
            url = f"s3://{BUCKET}/ckpt"

            def clean() -> None:
                shutil.rmtree(work / "out", ignore_errors=True)
                s3.reset()

            def fetched(_: Result) -> dict[str, Any]:
                c = s3.reset()
                return {"bytes_fetched": c["bytes"], "requests": c["requests"]}

            write = [sys.executable, "-m", "reshard.cli", "write", url, "--tp", "4", "-o", str(work / "out"),
                     "--no-progress"]
            blocks = {**s3.env, "RESHARD_STORE_WASTE": "10", "RESHARD_STORE_MAX_GAP": str(1 << 20)}
            cases = [
                Case("ranged", write, env=s3.env, setup=clean, extra=fetched, note="reshard write s3://... --tp 4"),
                Case("ranged-blocks", write, env=blocks, setup=clean, extra=fetched,
                     note="the same, gaps up to 1 MiB merged (WASTE=10)"),
                Case("ranged-rank0", [*write, "--ranks", "0"], env=s3.env, setup=clean, extra=fetched,
                     note="reshard write s3://... --tp 4 --ranks 0 (one node's share)"),
                Case("download", [sys.executable, "-m", "bench.compare_s3_write", "--child-download", url,
                                  str(work), str(work / "out")], env=s3.env, setup=clean, extra=fetched,
                     note="download whole checkpoint (obstore), then reshard write DIR --tp 4"),
            ]
            res = interleave("s3 write tp=4", cases, reps=args.reps, warmup=args.warmup, baseline="download")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"checkpoint: {total / 2**20:.1f} MiB in 4 files")
    print("| case | median s | ratio to download | bytes fetched (MiB) | requests | peak RssAnon MiB |")
    print("|---|---|---|---|---|---|")
    for name, c in res["cases"].items():
        r = c["runs"][-1]
        print(f"| {name} | {c['median_s']:.2f} | {c['ratio_to_baseline']:.2f} | {r['bytes_fetched'] / 2**20:.1f} | "
              f"{r['requests']} | {c['median_peak_rss_anon_mib']:.0f} |")
    return res


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

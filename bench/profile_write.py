"""What bounds `reshard write`: the cost of each thing it does, measured alone, interleaved (a diagnostic).

    python -m bench.profile_write CKPT --tp 4 [--rounds 3]

Per round, on the same bytes: the CLI's start-up (a fresh interpreter running `reshard write --help`);
copying the checkpoint's files in the kernel (`copy_file_range`, what `cp -r` does); sha256 of as many
bytes (read back from the page cache in blocks and hashed, what the writer does); fsync of that many freshly
written bytes; and the real `write_shards`. Medians are printed as JSON. Outputs are deleted and dirty
pages flushed between steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.compare_write import reshard_bin
from bench.measure import median
from reshard.io.hashing import file_sha256


def _copy_all(files: list[Path], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    dst = []
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as src, open(out / f.name, "wb") as d:
            off = 0
            while off < size:
                off += os.copy_file_range(src.fileno(), d.fileno(), size - off, off, off)
        dst.append(out / f.name)
    return dst


def _sha256_read_back(files: list[Path]) -> None:
    for f in files:
        file_sha256(f)


def _fsync_all(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def one_round(src: Path, tp: int, out: Path) -> dict[str, float]:
    from reshard.io.sinks.write import write_shards
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    files = sorted(src.glob("*.safetensors"))
    t: dict[str, float] = {}

    def timed(name: str, fn: Any, *a: Any, sync: bool = True) -> Any:
        if sync:
            os.sync()
        t0 = time.perf_counter()
        r = fn(*a)
        t[name] = time.perf_counter() - t0
        return r

    os.sync()
    t0 = time.perf_counter()
    subprocess.run([reshard_bin(), "write", "--help"], check=True, stdout=subprocess.DEVNULL)
    t["start-up (reshard write --help)"] = time.perf_counter() - t0
    timed("kernel copy of the checkpoint (copy_file_range, like cp -r)", _copy_all, files, out / "copy")
    shutil.rmtree(out / "copy")
    timed("sha256 of the same bytes (read back in 4 MiB blocks, one thread)", _sha256_read_back, files)
    copied = timed("kernel copy of the checkpoint again", _copy_all, files, out / "copy2")
    timed("fsync of those freshly copied bytes", _fsync_all, copied, sync=False)
    shutil.rmtree(out / "copy2")
    ckpt, manifest = timed("open + plan (headers only)", lambda: open_source(src))
    plan = make_plan(ckpt, manifest, tp)
    timed("write_shards (all of it, in-process)", lambda: write_shards(ckpt, plan, out / "shards", progress=False))
    shutil.rmtree(out / "shards")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_write")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data" / "work" / "profile")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rounds = [one_round(args.checkpoint, args.tp, args.out) for _ in range(args.rounds + 1)][1:]
    report: dict[str, Any] = {"checkpoint_bytes": sum(f.stat().st_size for f in args.checkpoint.glob("*.safetensors")),
                              "tp": args.tp, "rounds": args.rounds,
                              "median_s": {k: round(median(r[k] for r in rounds), 3) for k in rounds[0]}}
    shutil.rmtree(args.out, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench.gather [--reps 7]`: gathering strided runs (a row-split tensor's slice), two ways.

For runs of 2 bytes to 16 KiB, `stride` = 4 runs apart (tp=4) over 64 MiB of source, the copy
`reshard.plan.reads.runs_array` makes (one numpy element per run: numpy copies each whole) against the
(count, run) uint8 view it replaced, interleaved, best of `--reps`. Prints GB/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from reshard.plan.reads import runs_array

RUNS = (2, 6, 16, 64, 256, 1024, 2816, 4096, 16384)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gather", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    src = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    print(f"{'run bytes':>9}  {'(count, run) u8':>16}  {'runs_array':>11}  ratio")
    for run in RUNS:
        stride = 4 * run
        count = (len(src) - stride) // stride
        out = np.empty(count * run, np.uint8)
        views = {
            "u8": (out.reshape(count, run), np.lib.stride_tricks.as_strided(src[3:], (count, run), (stride, 1))),
            "runs": (runs_array(out, 0, run, run, count), runs_array(src, 3, run, stride, count)),
        }
        best = dict.fromkeys(views, float("inf"))
        for _ in range(args.reps):
            for name, (dst, s) in views.items():
                t0 = time.perf_counter()
                dst[...] = s
                best[name] = min(best[name], time.perf_counter() - t0)
                assert np.array_equal(out.reshape(count, run), views["u8"][1])
        gb = {k: count * run / v / 1e9 for k, v in best.items()}
        print(f"{run:>9}  {gb['u8']:>12.2f} GB/s  {gb['runs']:>6.2f} GB/s  {gb['runs'] / gb['u8']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

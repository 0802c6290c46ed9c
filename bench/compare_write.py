"""Comparisons 1 and 2: `reshard write` against `cp -r`, `cp -r + sync + sha256sum` (the same work:
copy, fsync and hash every output file; the target is <= 1.0x of it) and two hand-written scripts;
its peak memory.

All outputs go to the same filesystem as the checkpoint (under `bench/data/work`); each output is
removed and dirty pages are flushed (`sync`) before every run, outside the timing. Every command
reads its inputs from the page cache (a warm-up round runs first; caches are not dropped).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.data import weight_bytes
from bench.interleave import Case, drop_dirty, interleave

BASELINES = str(Path(__file__).resolve().parent / "baselines.py")
SAME_WORK = "cp -r + sync + sha256sum"  # the same work as reshard write (copy, fsync, hash): <= 1.0x of it
SAME_WORK_OPENSSL = "cp -r + sync + openssl sha256"  # a stricter reading: the same hash code reshard uses
CP_SYNC = "cp -r + sync files"  # issue 23's baseline, `cp -r && sync` (durability alone): reshard write <= 1.0x of it
CP_SYNC_RECYCLED = "cp -r + sync files, page cache recycled"  # its best case here: the stricter baseline


def reshard_bin() -> str:
    exe = Path(sys.executable).with_name("reshard")
    return str(exe) if exe.exists() else shutil.which("reshard") or "reshard"


def _fresh(path: Path) -> Callable[[], None]:
    def setup() -> None:
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_dirty()

    return setup


def _recycled(src: Path, path: Path) -> Callable[[], None]:
    """`_fresh`, after copying `src` to `path` and deleting it: the copy's page cache was freed just now, so
    the timed copy gets pages at once. On this VM a page not used for a while costs a fault to the host
    (cp -r took 0.33 s right after such a delete, 1.4-1.7 s after an O_DIRECT write had freed none);
    O_DIRECT writes (reshard's) take no page cache either way."""
    fresh = _fresh(path)

    def setup() -> None:
        fresh()
        shutil.copytree(src, path)
        shutil.rmtree(path)
        drop_dirty()

    return setup


def _cleanup(path: Path) -> Callable[[], None]:
    def teardown() -> None:
        if path.exists():
            shutil.rmtree(path)

    return teardown


def write_cases(src: Path, work: Path, tp: int, *, scripts: bool = True, cp_sync: bool = False) -> list[Case]:
    """`cp -r` (the baseline), `reshard write --tp N`, and the hand-written scripts, on `src`."""
    py, rs = sys.executable, reshard_bin()
    cases = []

    def add(name: str, argv: list[str], out: Path, note: str = "", setup: Callable[[], None] | None = None) -> None:
        cases.append(Case(name, argv, setup=setup or _fresh(out), teardown=_cleanup(out), note=note))

    out = work / "cp"
    add("cp -r", ["cp", "-r", str(src), str(out)], out, "in-kernel copy (copy_file_range), no fsync")
    if cp_sync:
        out = work / "cp-sync"
        cp_sync_argv = ["sh", "-c", f'cp -r "{src}" "{out}" && sync "{out}"/*']
        add(CP_SYNC, cp_sync_argv, out, "cp -r, then fsync of every copied file (durability like reshard's)")
        add(CP_SYNC_RECYCLED, cp_sync_argv, out,
            "the same, just after a copy of the checkpoint was deleted: its page cache is recycled", _recycled(src, out))
    out = work / "cp-sync-sha"
    add(SAME_WORK, ["sh", "-c", f'cp -r "{src}" "{out}" && sync "{out}"/* && sha256sum "{out}"/* > /dev/null'], out,
        "the same work as reshard write: copy, fsync and sha256 of every output file")
    if shutil.which("openssl"):
        out = work / "cp-sync-openssl"
        add(SAME_WORK_OPENSSL, ["sh", "-c", f'cp -r "{src}" "{out}" && sync "{out}"/* && openssl dgst -sha256 "{out}"/* > /dev/null'],
            out, "the same work, hashed by OpenSSL (as hashlib does; coreutils' sha256sum is slower)")
    out = work / f"reshard-tp{tp}"
    add(f"reshard write --tp {tp}", [rs, "write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"], out,
        "fsync + sha256 of every rank file, atomic rename")
    if scripts:
        for method, note in (("chunk", "load_file all + torch.chunk + save_file per rank"),
                             ("slice", "per rank: safe_open get_slice + save_file")):
            out = work / f"{method}-tp{tp}"
            add(f"script {method}", [py, BASELINES, method, str(src), str(out), "--tp", str(tp)], out, note)
    return cases


def startup_case() -> Case:
    """The fixed cost of starting the CLI (interpreter + imports), as a diagnostic."""
    return Case("reshard --help (start-up)", [reshard_bin(), "write", "--help"], note="interpreter + imports only")


def reshard_shard_cases(shard_dir: Path, src: Path, work: Path, tp: int) -> list[Case]:
    """Re-shard a tp=P shard directory to tp; baseline: `cp -r` of that directory."""
    rs = reshard_bin()
    cases = []
    for name, argv, out, note in (
        ("cp -r (shard dir)", ["cp", "-r", str(shard_dir), str(work / "cp-shards")], work / "cp-shards", ""),
        (f"reshard write shards -> tp{tp}", [rs, "write", str(shard_dir), "--tp", str(tp), "-o",
                                             str(work / "from-shards"), "--no-progress"], work / "from-shards",
         "source: the tp=4 rank files"),
        (f"reshard write full -> tp{tp}", [rs, "write", str(src), "--tp", str(tp), "-o",
                                           str(work / "from-full"), "--no-progress"], work / "from-full",
         "source: the full checkpoint"),
    ):
        cases.append(Case(name, argv, setup=_fresh(out), teardown=_cleanup(out), note=note))
    return cases


def run_write(ckpts: dict[str, Path], work: Path, *, full: bool, reps: int) -> list[dict[str, Any]]:
    """Comparison 1 (and the timings comparison 2 reads its memory from)."""
    work.mkdir(parents=True, exist_ok=True)
    results = []
    src = ckpts["1gb"]
    cases = write_cases(src, work, 4, cp_sync=True)  # cp -r && sync: issue 23's literal baseline, every mode
    cases.append(startup_case())
    res = interleave("write 1gb tp4", cases, reps=reps, baseline="cp -r")
    res.update(checkpoint="1gb", checkpoint_bytes=weight_bytes(src), tp=4)
    results.append(res)
    if full:
        for tp in (2, 8):
            res = interleave(f"write 1gb tp{tp}", write_cases(src, work, tp), reps=reps, baseline="cp -r")
            res.update(checkpoint="1gb", checkpoint_bytes=weight_bytes(src), tp=tp)
            results.append(res)
        results.append(_from_shards(src, work, reps))
    if "4gb" in ckpts:
        src4 = ckpts["4gb"]
        res = interleave("write 4gb tp4", write_cases(src4, work, 4, scripts=False), reps=reps, baseline="cp -r")
        res.update(checkpoint="4gb", checkpoint_bytes=weight_bytes(src4), tp=4)
        results.append(res)
    return results


def _from_shards(src: Path, work: Path, reps: int) -> dict[str, Any]:
    shard_dir = work / "tp4-source"
    _make_shards(src, shard_dir, 4)
    try:
        res = interleave("reshard tp4 dir -> tp2", reshard_shard_cases(shard_dir, src, work, 2), reps=reps,
                         baseline="cp -r (shard dir)")
    finally:
        shutil.rmtree(shard_dir, ignore_errors=True)
    res.update(checkpoint="1gb", checkpoint_bytes=weight_bytes(src), tp=2, source_tp=4)
    return res


def _make_shards(src: Path, out: Path, tp: int) -> None:
    if out.exists():
        shutil.rmtree(out)
    subprocess.run([reshard_bin(), "write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL)


def memory_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Comparison 2: peak RssAnon of `reshard write --tp 4` on each checkpoint size, and the growth."""
    peaks: dict[str, float] = {}
    for r in results:
        case = r["cases"].get("reshard write --tp 4")
        if case and r.get("tp") == 4:
            peaks[r["checkpoint"]] = case["peak_rss_anon_mib"]
    out: dict[str, Any] = {"peak_rss_anon_mib": peaks}
    if "1gb" in peaks and "4gb" in peaks:
        out["growth_1gb_to_4gb"] = peaks["4gb"] / peaks["1gb"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.compare_write [--reps N] [--tp 4]`: only the write-speed targets' comparison
    (cp -r, cp -r && sync plain and with its page cache recycled, cp -r + sync + openssl sha256, reshard
    write), interleaved, on the 1 GB checkpoint. The target is issue 23's: <= 1.0x of `cp -r && sync` in its
    best case here, the page cache recycled (`_recycled`)."""
    import argparse
    import json

    from bench import data
    from bench.targets import pair_ratio

    p = argparse.ArgumentParser(prog="python -m bench.compare_write", description=main.__doc__)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--data", type=Path, default=data.DATA)
    args = p.parse_args(argv)
    src = data.checkpoint("1gb", root=args.data)
    data.warm_page_cache(src)
    work = args.data / "work"
    cases = [c for c in write_cases(src, work, args.tp, scripts=False, cp_sync=True) if c.name != SAME_WORK]
    try:
        res = interleave(f"write 1gb tp{args.tp}", cases, reps=args.reps, baseline="cp -r")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name = f"reshard write --tp {args.tp}"
    ratios = {f"vs {b}": pair_ratio(res, name, b) for b in (CP_SYNC_RECYCLED, CP_SYNC, SAME_WORK_OPENSSL, "cp -r")}
    medians = {c: round(v["median_s"], 3) for c, v in res["cases"].items()}
    print(json.dumps({"median_s": medians, "ratios": {k: round(v, 3) for k, v in ratios.items() if v is not None},
                      "target": f"{name} <= 1.0x {CP_SYNC_RECYCLED}", "met": ratios["vs " + CP_SYNC_RECYCLED] <= 1.0},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

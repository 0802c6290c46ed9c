"""All 8 ranks of tp=8 pulled at once through one `reshard serve` whose root is a static HTTP server,
against downloading the checkpoint and serving it locally (interleaved; the 1 GB checkpoint).

    python -m bench.compare_store_serve [--reps 3] [--tp 8] [--no-plain]

  download + serve    curl each file from the store into a local root (4 at once), then the 8 pulls from
                      `reshard serve --root LOCAL`
  store, cache        the 8 pulls from `reshard serve --root http://STORE/files`, its store cache emptied
                      before each round (every block fetched once, then read from the cache)
  store, no cache     the same with RESHARD_STORE_CACHE=0: every pull fetches what it reads (--no-plain: skipped)

Same conditions for both sides: every server runs 2 workers (one per core) with the copies of gathered
pieces off (`RESHARD_GATHER_CACHE=0`: a start-up storm pulls each shard once, and a store root keeps
none), and the downloaded files get the same mtime every round, so the shards' ETags, and the sha256
digests the service keeps by ETag, stay the same from round to round for both, as a store object's
ETag does (an earlier version left the local side's copies warm across rounds: 2.57 s there against
about 3 s cold). The store is `reshard.testing.fileserver` (Starlette FileResponse, Range) counting the body
bytes it sends. Pulls are `curl -s -o /dev/null`, 8 at once, timed from the first request (or the
download) to the last byte. Writes `bench/results/store_serve.{md,json}`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from bench import data
from bench.interleave import Case, interleave
from bench.measure import Result, median
from bench.report import targets_table, write_md_json
from bench.servers import reshard_serve_argv
from reshard.testing.local_servers import StoreServer, free_port, http_server, server

NAME = "llama"
RESULTS = Path(__file__).resolve().parent / "results"
TITLE = "store serve 1gb tp8"
MTIME = 1_700_000_000  # the downloaded files' mtime: the local shards' ETags stay the same from round to round
BASE_ENV = {"NO_PROXY": "127.0.0.1,localhost", "OMP_NUM_THREADS": "1", "RESHARD_GATHER_CACHE": "0"}


def _pulls(base: str, tp: int) -> str:
    """Shell: the `tp` ranks pulled at once, each printing the bytes it got."""
    urls = " ".join(f"'{base}/v1/checkpoints/{NAME}/shards/{r}?tp={tp}'" for r in range(tp))
    return f"for u in {urls}; do curl -sf -o /dev/null -w '%{{size_download}}\\n' \"$u\" & done; wait"


def _download(store: str, files: list[str], dest: Path) -> str:
    """Shell: every file of the checkpoint from the store into `dest` (4 at once), mtimes set."""
    gets = " ".join(f"'{f}'" for f in files)
    return (f"mkdir -p '{dest}' && printf '%s\\n' {gets} | xargs -P 4 -I F curl -sf -o '{dest}/F' '{store}/F' && "
            f"touch -d @{MTIME} '{dest}'/*")


def _case(name: str, script: str, store: StoreServer, before: Any = None, note: str = "") -> Case:
    def setup() -> None:
        if before is not None:
            before()
        store.reset()

    def extra(res: Result) -> dict[str, Any]:
        got = [int(x) for x in res.stdout.split()]
        return {"store_bytes": store.reset()["bytes"], "received": sum(got), "pulls": len(got)}

    return Case(name, ["sh", "-c", script], setup=setup, extra=extra, note=note)


def run(reps: int, tp: int, work: Path, *, plain: bool = True) -> dict[str, Any]:
    ckpt = data.checkpoint("1gb")
    web_root = work / "store"
    (web_root / NAME).mkdir(parents=True, exist_ok=True)
    files = sorted(p.name for p in ckpt.iterdir() if p.suffix in (".safetensors", ".json") and p.name != data.STAMP)
    for f in files:
        if not (web_root / NAME / f).exists():
            os.link(ckpt / f, web_root / NAME / f)
    weights = sum((ckpt / f).stat().st_size for f in files if f.endswith(".safetensors"))
    local_root, cache = work / "local", work / "cache"
    (local_root / NAME).mkdir(parents=True, exist_ok=True)
    env = {**BASE_ENV, "RESHARD_STORE_CACHE_DIR": str(cache)}
    with http_server(web_root) as store, contextlib.ExitStack() as servers:
        url = f"{store.url}/files"
        roots = {"local": (local_root, {}), "cached": (url, {})}
        if plain:
            roots["plain"] = (url, {"RESHARD_STORE_CACHE": "0"})
        bases = {}
        for name, (root, extra) in roots.items():
            port = free_port()
            bases[name] = f"http://127.0.0.1:{port}"
            servers.enter_context(server(reshard_serve_argv(root, port, workers=2), bases[name] + "/healthz",  # type: ignore[arg-type]
                                         env={**env, **extra}, log=work / f"{name}.log"))
        cases = [
            _case("download + serve", _download(f"{url}/{NAME}", files, local_root / NAME) + "; " + _pulls(bases["local"], tp),
                  store, lambda: shutil.rmtree(local_root / NAME, ignore_errors=True),
                  note="curl the checkpoint into a local root, then the pulls from reshard serve on it"),
            _case("store, cache", _pulls(bases["cached"], tp), store, lambda: _empty(cache),
                  note="reshard serve --root http://STORE (store cache emptied before each round)"),
        ]
        if plain:
            cases.append(_case("store, no cache", _pulls(bases["plain"], tp), store,
                               note="the same, RESHARD_STORE_CACHE=0: each pull fetches what it reads"))
        res = interleave(TITLE, cases, reps=reps, warmup=1, baseline="download + serve")
    res.update(tp=tp, checkpoint_bytes=weights, files=len(files), load=os.getloadavg()[0])
    for c in res["cases"].values():
        c["median_store_bytes"] = median(r["store_bytes"] for r in c["runs"])
        c["received"] = c["runs"][-1]["received"]
    return res


def _empty(cache: Path) -> None:
    if cache.exists():
        for p in cache.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def markdown(res: dict[str, Any], reps: int) -> str:
    from bench.targets import store_serve_targets

    full = res["checkpoint_bytes"]
    base = res["cases"]["download + serve"]
    lines = [f"# {res['tp']} ranks of tp={res['tp']} pulled at once through one service whose root is a static HTTP "
             f"server (python -m bench.compare_store_serve --reps {reps}; 1 GB checkpoint, medians of {reps} "
             "interleaved rounds after a warm-up; every server on 2 workers, copies of gathered pieces off)", "",
             f"checkpoint: {full / 2**20:.0f} MiB of weights in {res['files'] - 2} files; each case received "
             f"{base['received'] / 2**20:.0f} MiB in {res['tp']} shards; load average {res.get('load', 0):.1f} "
             "at the end (shared 2-core VM)", "",
             "| case | median s | ratio to download + serve | MiB from the store | x checkpoint |",
             "|---|---|---|---|---|"]
    for name, c in res["cases"].items():
        lines.append(f"| {name} | {c['median_s']:.2f} | {c['ratio_to_baseline']:.2f} | "
                     f"{c['median_store_bytes'] / 2**20:.0f} | {c['median_store_bytes'] / full:.2f} |")
    lines += ["", *targets_table(store_serve_targets(res))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_store_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--no-plain", action="store_true", help="skip the case without a cache (~1 min a round)")
    p.add_argument("--out", type=Path, default=RESULTS / "store_serve.md")
    args = p.parse_args(argv)
    work = data.DATA / "work-store-serve"
    try:
        res = run(args.reps, args.tp, work, plain=not args.no_plain)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_md_json(args.out, markdown(res, args.reps), res)
    print(json.dumps({n: [r["wall_s"] for r in c["runs"]] for n, c in res["cases"].items()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A second node, simulated (issue 23, item 4): a tp=4 group whose checkpoint is on the other side of a
1 Gbit/s link, interleaved:

- copy the whole checkpoint to the node over the link (4 parallel HTTP downloads from a static file
  server), then `from_pretrained(tp_plan="auto")` under torchrun, and under `reshard launch`;
- `fill_model` from the service over the link under torchrun, under `reshard launch`, and under
  `reshard launch --prefetch` (the transfers start before the imports).

The link is `bench/linkproxy.py`: a user-space TCP relay on 127.0.0.1 whose answers share one token
bucket (the node's interface), in front of the file server and of `reshard serve`; `lo` itself is not
shaped. Time: from the start (of the copy, or of the launch) until every rank's model is ready.
Bytes over the link: what the relay carried, both ways. The logits of every run must agree.

    python -m bench.compare_link [--reps 3] [--rate-mbit 1000]   # writes bench/results/link.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.compare_fill import NAME, common_args, linked_root, prepared, summarise, worker_case
from bench.compare_train import expected_bytes
from bench.interleave import interleave
from bench.linkproxy import LinkProxy
from bench.servers import reshard_serve_argv
from reshard.testing.local_servers import free_port, server

TP = 4
BASELINE = "copy + torchrun from_pretrained"
RESULTS = Path(__file__).resolve().parent / "results" / "link.json"


def download(base: str, names: list[str], dest: Path) -> None:
    """`names` from the static server at `base` into `dest`, 4 at a time (what a node's copy does)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)

    def get(name: str) -> None:
        with urllib.request.urlopen(f"{base}/{name}", timeout=600) as r, open(dest / name, "wb") as f:
            shutil.copyfileobj(r, f, 8 << 20)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(get, names))


def link_cases(ckpt: Path, service: LinkProxy, files: LinkProxy, work: Path) -> list[Any]:
    url = f"{service.url}/v1/checkpoints/{NAME}"
    names = sorted(p.name for p in ckpt.iterdir() if p.suffix in (".safetensors", ".json") and p.name != "bench-ckpt.json")
    node = work / "node-copy"

    def copy() -> None:
        download(files.url, names, node)

    def link_bytes() -> float:
        return sum(p.bytes_down + p.bytes_up for p in (service, files))

    plan = [(BASELINE, "torchrun", "from_pretrained", str(node), copy, ()),
            ("copy + launch from_pretrained", "launch", "from_pretrained", str(node), copy, ()),
            ("torchrun + fill (service)", "torchrun", "fill", url, None, ()),
            ("launch + fill (service)", "launch", "fill", url, None, ()),
            ("launch --prefetch + fill (service)", "launch", "fill", url, None, ("--prefetch", url))]
    return [worker_case(name, launcher, mode, source, TP, work / f"out-link-{i}", link_bytes, prepare=prepare,
                        flags=flags) for i, (name, launcher, mode, source, prepare, flags) in enumerate(plan)]


def run_link(ckpt: Path, work: Path, *, reps: int, rate_mbit: float) -> dict[str, Any]:
    work = work / "link"
    root = linked_root(ckpt, work)
    sport, fport = free_port(), free_port()
    files_argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(root / NAME), str(fport)]
    rate = rate_mbit * 1e6 / 8
    with server(reshard_serve_argv(root, sport), f"http://127.0.0.1:{sport}/healthz", log=work / "serve.log"), \
            server(files_argv, f"http://127.0.0.1:{fport}/config.json", log=work / "files.log"), \
            LinkProxy(("127.0.0.1", sport), rate_bytes=rate) as service, \
            LinkProxy(("127.0.0.1", fport), rate_bytes=rate) as files:
        cases = link_cases(root / NAME, service, files, work)
        res = interleave(f"tp={TP} over a {rate_mbit:.0f} Mbit/s link", cases, reps=reps, warmup=1, baseline=BASELINE)
    out = summarise(res, TP, expected_bytes(ckpt, TP), reference="copy + launch from_pretrained")
    out.update(rate_mbit=rate_mbit, checkpoint_bytes=sum((root / NAME / n).stat().st_size for n in os.listdir(root / NAME)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_link", description=__doc__.split("\n\n")[0])
    common_args(p, RESULTS)
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    args = p.parse_args(argv)
    root, ckpt, meta = prepared(args, f"python -m bench.compare_link --reps {args.reps} --rate-mbit {args.rate_mbit:g}")
    comp = run_link(ckpt, root / "work", reps=args.reps, rate_mbit=args.rate_mbit)
    meta["load_at_end"] = os.getloadavg()[0]
    args.out.write_text(json.dumps({"meta": meta, "comparisons": [comp]}, indent=2, default=str) + "\n")
    for name, c in comp["cases"].items():
        print(f"{name}: {c['median_ready_s']:.1f} s, {c['ratio_to_baseline']:.2f}x, "
              f"{(c['median_counted_bytes'] or 0) / 1e9:.2f} GB over the link")
    return 0


if __name__ == "__main__":
    sys.exit(main())

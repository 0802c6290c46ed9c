"""`reshard plan`, `reshard write` and `reshard pull`, with the layout flags they share."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from reshard.errors import PlanError
from reshard.format.rank_file import rank_file_name
from reshard.io.progress import add_progress_flags, human
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.io.source.stores import is_url
from reshard.layout.mesh import DIMENSIONS, Layout
from reshard.plan.planner import make_plan
from reshard.plan.types import Plan, plan_to_json
from reshard.rules.engines import known_engines


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"--ranks {text!r}: expected comma-separated integers like 0,2") from None
    return sorted(set(ranks))


def _plan(args: argparse.Namespace, *, lazy: bool = False) -> tuple[Any, Plan]:
    ckpt, manifest = open_source(args.checkpoint, rules=args.rules, engine=args.engine)
    ranks = parse_ranks(args.ranks) if getattr(args, "ranks", None) else None
    plan = make_plan(ckpt, manifest, layout_of(args), ranks=ranks, strict=args.strict, lazy=lazy)
    for w in plan.warnings:
        print(f"reshard: warning: {w}", file=sys.stderr)
    return ckpt, plan


def cmd_plan(args: argparse.Namespace) -> int:
    ckpt, plan = _plan(args, lazy=not args.json)  # the summary visits each rank once
    if args.json:
        json.dump(plan_to_json(plan, tensors=True), sys.stdout, indent=2)
        print()
        return 0
    print(f"checkpoint: {ckpt.root} ({len(ckpt.tensors)} tensors, {human(ckpt.total_bytes())})")
    print(f"manifest:   {plan.manifest.source}")
    world = f" ({plan.world} ranks)" if not plan.layout.tp_only else ""
    print(f"{plan.layout.describe()}{world}  plan {plan.digest[:16]}")
    print(f"{'rank':>5} {'tensors':>8} {'bytes out':>12} {'replicated':>12} {'bytes read':>12}")
    for rp in plan.ranks:
        s = rp.stats()
        print(f"{rp.rank:>5} {s['tensors']:>8} {human(s['bytes']):>12} {human(s['replicated_bytes']):>12} "
              f"{human(s['bytes_read']):>12}")
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    ckpt, plan = _plan(args)
    record = write_shards(ckpt, plan, args.out, progress=args.progress)  # a directory, or a store prefix
    total = sum(f["size"] for f in record["files"].values())
    where = args.out if is_url(args.out) else Path(args.out)
    done = ", ".join(f"{rank_list(record[k])} {k}" for k in ("kept", "written") if record.get(k))
    print(f"wrote {len(plan.ranks)} rank files ({human(total)} in {where}{': ' + done if done else ''}), "
          f"manifest: {plan.manifest.source}")
    return 0


def rank_list(ranks: list[int]) -> str:
    """'rank 0', 'ranks 1-3', 'ranks 0, 2-3': runs of consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    """--tp, --pp, --fsdp, --ep, --dp-replicate: the layout, each 1 unless given."""
    g = p.add_argument_group("layout", "parallel sizes, each 1 unless given; the world is pp x dp_replicate x fsdp "
                             "x tp ranks, numbered as transformers' DistributedConfig meshes number them")
    for d in DIMENSIONS:
        g.add_argument("--" + d.name.replace("_", "-"), type=int, default=d.default, help=d.help)


def layout_of(args: argparse.Namespace) -> Layout:
    return Layout.from_sizes(args)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint directory, .safetensors file, or directory of rank shards; "
                   "or a URL: s3://BUCKET/PREFIX, gs://..., http(s)://HOST/PATH/, hf://ORG/MODEL")
    add_layout_flags(p)
    p.add_argument("--rules", help="rule manifest (YAML/JSON); default: reshard-rules.yaml beside it, else config.json")
    p.add_argument("--strict", action="store_true", help="rules that match no tensor are errors")
    p.add_argument("--engine", choices=known_engines(),
                   help="cut each rank the way an inference engine holds it (vllm: its vocabulary split; docs/vllm.md)")


def add_commands(sub: Any) -> None:
    p = sub.add_parser("plan", help="dry run: what every rank file will contain, from headers alone")
    _common(p)
    p.add_argument("--json", action="store_true", help="print the full plan as JSON")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("write", help="write per-rank safetensors files (atomic) and reshard.json")
    _common(p)
    p.add_argument("-o", "--out", required=True, help="output directory, or s3://BUCKET/PREFIX (multipart uploads)")
    p.add_argument("--ranks", help="only these ranks, e.g. 0,2")
    add_progress_flags(p)
    p.set_defaults(func=cmd_write)
    _add_pull(sub)


def cmd_pull(args: argparse.Namespace) -> int:
    from reshard.io.client.shard_client import ShardClient  # httpx only when pulling

    if args.meta:
        return _pull_meta(args)
    layout = layout_of(args)
    if args.rank is None:
        raise PlanError("reshard pull: give --rank (and the layout: --tp ...) for a rank's shard, or --meta -o DIR "
                        "(config and tokenizer)")
    layout.check_rank(args.rank)
    with ShardClient(args.url, token=args.token, retries=args.retries, rules=args.rules, engine=args.engine) as client:
        out = args.out or rank_file_name(args.rank, layout.world)
        result = client.pull(args.rank, layout if not layout.tp_only else layout.tp, out, progress=args.progress,
                             resume=not args.no_resume)
    if result.get("kept"):
        print(f"rank {args.rank} of {layout.describe()} is already in place: {human(result['size'])}, "
              f"sha256 {result['sha256'][:16]}... verified, nothing downloaded -> {result['path']}", file=sys.stderr)
        return 0
    resumed = f", resumed at {human(result['resumed_from'])}" if result["resumed_from"] else ""
    print(f"pulled rank {args.rank} of {layout.describe()}: {human(result['size'])}{resumed}, "
          f"sha256 {result['sha256'][:16]}... -> {result['path']}", file=sys.stderr)
    return 0


def _pull_meta(args: argparse.Namespace) -> int:
    from reshard.io.client.shard_client import ShardClient

    if not args.out:
        raise PlanError("reshard pull --meta: give the directory to copy the files into with -o DIR")
    with ShardClient(args.url, token=args.token, retries=args.retries) as client:
        files = client.pull_meta(args.out)
    names = ", ".join(f["name"] for f in files) or "none"
    print(f"pulled {len(files)} small files ({names}) -> {args.out}", file=sys.stderr)
    return 0


def _add_pull(sub: Any) -> None:
    p = sub.add_parser("pull", help="download one rank shard from `reshard serve` (resumable, verified)")
    p.add_argument("url", help="checkpoint URL, http://HOST:PORT/v1/checkpoints/NAME")
    p.add_argument("--rank", type=int, help="global rank, 0..world-1")
    add_layout_flags(p)
    p.add_argument("--meta", action="store_true",
                   help="instead of a shard: the checkpoint's config.json, tokenizer and generation config into -o DIR")
    p.add_argument("--engine", choices=known_engines(), help="a shard cut the way an engine holds it (docs/vllm.md)")
    p.add_argument("-o", "--out", help="output file (default rank-RRRRR-of-WWWWW.safetensors); with --meta a directory")
    p.add_argument("--token", help="bearer token (default $RESHARD_TOKEN)")
    p.add_argument("--rules", help="label of a manifest stored on the server")
    p.add_argument("--retries", type=int, default=5, help="tries after a failure without progress (default 5)")
    p.add_argument("--no-resume", action="store_true", help="ignore a partial download left by an earlier try")
    add_progress_flags(p)
    p.set_defaults(func=cmd_pull)

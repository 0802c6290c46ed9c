"""`reshard plan`, `reshard write` and `reshard pull`, with the layout flags they share.

A training checkpoint (rank files + `optimizer/` + `trainer_state.json`, `reshard.trainer.snapshot`) is
two rank directories and a JSON file: `plan` plans both, `write` re-lays out all three. That is composed
here, over the one write path (`write_shards`, once per rank directory), because the trainer state's
JSON is owned by `reshard.trainer.state_json`, a layer above `reshard.io`; torch is imported only then.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from reshard.cli.common import add_json_flag, command, log, print_json
from reshard.cli.remote import is_service_url, meta_here, plan_from_service, pull_here, write_from_service
from reshard.errors import CheckpointError, PlanError
from reshard.format.rank_file import OPTIMIZER_DIR, rank_file_name
from reshard.io.progress import add_progress_flags, human
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.io.source.stores import is_url
from reshard.layout.mesh import DIMENSIONS, Layout
from reshard.plan.planner import make_plan
from reshard.plan.types import Plan, plan_head, plan_to_json
from reshard.rules.engines import known_engines


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"--ranks {text!r}: expected comma-separated integers like 0,2") from None
    return sorted(set(ranks))


def _plan(args: argparse.Namespace, *, lazy: bool = False, source: str | Path | None = None) -> tuple[Any, Plan]:
    ckpt, manifest = open_source(source or args.checkpoint, rules=args.rules, engine=args.engine)
    ranks = parse_ranks(args.ranks) if getattr(args, "ranks", None) else None
    plan = make_plan(ckpt, manifest, layout_of(args), ranks=ranks, strict=args.strict, lazy=lazy)
    for w in plan.warnings:
        log.warning("%s", w)
    return ckpt, plan


def optimizer_dir(checkpoint: str | Path) -> Path | None:
    """`CHECKPOINT/optimizer` when `checkpoint` is a local training checkpoint (it has AdamW's rank files)."""
    moments = Path(checkpoint) / OPTIMIZER_DIR
    return moments if not is_url(checkpoint) and moments.is_dir() else None


def cmd_plan(args: argparse.Namespace) -> int:
    if is_service_url(args.checkpoint):
        info, out = plan_from_service(args.checkpoint, layout_of(args), args, tensors=args.json)
        for w in out.get("warnings", ()):
            log.warning("%s", w)
        if args.json:
            print_json(out)
            return 0
        _print_plan(f"{args.checkpoint} ({len(info['tensors'])} tensors, {human(info['total_bytes'])})", out,
                    out["ranks"], {})
        return 0
    ckpt, plan = _plan(args, lazy=not args.json)  # the summary visits each rank once
    moments = optimizer_dir(args.checkpoint)
    oplan = _plan(args, lazy=not args.json, source=moments)[1] if moments is not None else None
    opt = {rp.rank: rp.size for rp in oplan.ranks} if oplan is not None else {}
    if args.json:
        out = plan_to_json(plan, tensors=True)
        if oplan is not None:  # a training checkpoint: the optimizer's rank files, planned by the same rules
            out["optimizer"] = plan_to_json(oplan, tensors=True)
            for entry in out["ranks"]:
                entry["optimizer_bytes"] = opt[entry["rank"]]
        print_json(out)
        return 0
    _print_plan(f"{ckpt.root} ({len(ckpt.tensors)} tensors, {human(ckpt.total_bytes())})", plan_head(plan),
                ({"rank": rp.rank, **rp.stats()} for rp in plan.ranks), opt)
    return 0


def _print_plan(checkpoint: str, head: dict[str, Any], ranks: Any, opt: dict[int, int]) -> None:
    """The plan as a table: one line per rank (`ranks`: `plan_to_json`'s entries, or their stats)."""
    layout = Layout.from_sizes({**(head.get("layout") or {}), "tp": head["tp"]})
    print(f"checkpoint: {checkpoint}")
    print(f"manifest:   {head['manifest_source']}")
    world = f" ({layout.world} ranks)" if not layout.tp_only else ""
    print(f"{layout.describe()}{world}  plan {head['plan'][:16]}")
    extra = f" {'optimizer':>12}" if opt else ""
    print(f"{'rank':>5} {'tensors':>8} {'bytes out':>12} {'replicated':>12} {'bytes read':>12}{extra}")
    for s in ranks:
        count = s["tensors"] if isinstance(s["tensors"], int) else len(s["tensors"])
        more = f" {human(opt[s['rank']]):>12}" if opt else ""
        print(f"{s['rank']:>5} {count:>8} {human(s['bytes']):>12} {human(s['replicated_bytes']):>12} "
              f"{human(s['bytes_read']):>12}{more}")
    if opt:
        print(f"training checkpoint: optimizer (AdamW's exp_avg, exp_avg_sq) {human(sum(opt.values()))} in "
              f"{OPTIMIZER_DIR}/, cut like the parameters")


def cmd_write(args: argparse.Namespace) -> int:
    ranks = parse_ranks(args.ranks) if args.ranks else None
    if is_service_url(args.checkpoint):
        record = write_from_service(args.checkpoint, layout_of(args), args.out, args, ranks=ranks)
        return _report_write(args, record, record["manifest"]["source"])
    moments = optimizer_dir(args.checkpoint)
    state = _begin_training_write(args) if moments is not None else None
    ckpt, plan = _plan(args)
    record = write_shards(ckpt, plan, args.out, progress=args.progress, force=args.force)  # a directory, or a store prefix
    extra = _write_training_rest(args, moments, record, state) if moments is not None and state is not None else 0
    return _report_write(args, record, plan.manifest.source, extra=extra)


def _report_write(args: argparse.Namespace, record: dict[str, Any], manifest: str, *, extra: int = 0) -> int:
    """What `write` wrote: a line, or with --json the record (`reshard.json`'s content, `kept`, `written`)."""
    total = sum(f["size"] for f in record["files"].values()) + extra
    if args.json:
        print_json({"out": str(args.out), "bytes": total, **{k: v for k, v in record.items() if k != "config"}})
        return 0
    where = args.out if is_url(args.out) else Path(args.out)
    done = ", ".join(f"{rank_list(record[k])} {k}" for k in ("kept", "written") if record.get(k))
    count = len(record["kept"]) + len(record["written"]) if "written" in record else len(record["files"])
    print(f"wrote {count} rank files ({human(total)} in {where}{': ' + done if done else ''}), "
          f"manifest: {manifest}")
    return 0


def _begin_training_write(args: argparse.Namespace) -> dict[str, Any]:
    """The trainer state of the training checkpoint `args.checkpoint`, checked: it is re-laid out whole, at
    a tp or fsdp x tp, into a local directory (what `--resume` reads), whose old `trainer_state.json` is
    removed first (until the new one is written last, the directory is no checkpoint)."""
    from reshard.trainer.state_json import STATE_NAME, read_state

    layout = layout_of(args)
    if layout != Layout(fsdp=layout.fsdp, tp=layout.tp):
        raise PlanError(f"{args.checkpoint} is a training checkpoint, which holds one replica's fsdp x tp ranks: re-lay "
                        f"it with --tp and --fsdp only (not {layout.describe()}); a resume at --dp D reads the same files")
    if args.ranks or is_url(args.out) or args.engine:
        raise PlanError(f"{args.checkpoint} is a training checkpoint: `reshard write` re-lays it out whole into a "
                        "local directory; drop --ranks/--engine and give -o a directory")
    state = read_state(Path(args.checkpoint))
    if state is None:
        raise CheckpointError(f"{args.checkpoint}: {OPTIMIZER_DIR}/ without {STATE_NAME}, not a complete training "
                        "checkpoint; write from a checkpoint the trainer saved (or its parameters alone)")
    (Path(args.out) / STATE_NAME).unlink(missing_ok=True)
    return state


def _write_training_rest(args: argparse.Namespace, moments: Path, record: dict[str, Any], state: dict[str, Any]) -> int:
    """The optimizer's rank files (the same plan, over `moments`), then `trainer_state.json` last (what makes
    the directory a checkpoint), its per-rank RNG the states a resume at another layout reseeds to."""
    from reshard.io.outfs import write_json_atomic
    from reshard.trainer.resume import reseed
    from reshard.trainer.state_json import STATE_NAME, relaid_state, seeded_rng

    out = Path(args.out)
    ockpt, oplan = _plan(args, source=moments)
    orecord = write_shards(ockpt, oplan, out / OPTIMIZER_DIR, progress=args.progress, force=args.force)
    files = {**{k: f["sha256"] for k, f in record["files"].items()},
             **{f"{OPTIMIZER_DIR}/{k}": f["sha256"] for k, f in orecord["files"].items()}}
    layout, step, seed = oplan.layout, int(state["step"]), int(state["extra"].get("seed", 0))
    write_json_atomic(out / STATE_NAME, relaid_state(state, layout=layout, files=files, rng=[
        seeded_rng(reseed(seed, step, r)) for r in range(layout.world)]))
    if not args.json:  # a result of the write, as its last line is
        print(f"training checkpoint at step {step}: optimizer re-laid out too, {STATE_NAME} for {layout.describe()} "
              "(each rank's RNG reseeded from (seed, step, rank))")
    return sum(f["size"] for f in orecord["files"].values())


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


SOURCE_HELP = ("checkpoint: a directory (or .safetensors file, or directory of rank files), a store URL "
               "(s3://BUCKET/PREFIX, gs://..., hf://ORG/MODEL, http(s)://HOST/PATH/ of a static server) or the "
               "service's checkpoint URL http://HOST:PORT/v1/checkpoints/NAME")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help=SOURCE_HELP)
    add_layout_flags(p)
    p.add_argument("--rules", help="rule manifest (YAML/JSON); default: reshard-rules.yaml beside it, else config.json. "
                   "From the service: the label of a manifest stored there")
    p.add_argument("--strict", action="store_true", help="rules that match no tensor are errors")
    p.add_argument("--engine", choices=known_engines(),
                   help="cut each rank the way an inference engine holds it (vllm: its vocabulary split; docs/vllm.md)")
    p.add_argument("--token", help="the service's bearer token (default $RESHARD_TOKEN)")


def add_commands(sub: Any) -> None:
    p = command(sub, "plan", help="dry run: what every rank file will contain, from headers alone", examples_=(
        "reshard plan ckpt/ --tp 4",
        "reshard plan ckpt/ --tp 2 --fsdp 2 --json | jq '.ranks[0].tensors[0]'",
        "reshard plan s3://bucket/llama --tp 8 --rules rules.yaml",
        "reshard plan http://127.0.0.1:8000/v1/checkpoints/llama --tp 4"))
    _common(p)
    add_json_flag(p, "the full plan (every rank's tensors, offsets and source slices)")
    p.set_defaults(func=cmd_plan)
    p = command(sub, "write", help="write per-rank safetensors files (atomic) and reshard.json", examples_=(
        "reshard write ckpt/ --tp 4 -o shards/",
        "reshard write ckpt/ --tp 4 --ranks 0,1 -o shards/        # only some ranks",
        "reshard write shards/ --tp 2 -o shards-tp2/               # re-lay rank files out",
        "reshard write ckpt/ --tp 4 -o s3://bucket/llama-tp4/",
        "reshard write http://127.0.0.1:8000/v1/checkpoints/llama --tp 4 -o shards/"))
    _common(p)
    p.add_argument("-o", "--out", required=True,
                   help="output directory (made, with its parents, if missing; removed again if nothing was written), "
                   "or s3://BUCKET/PREFIX (multipart uploads)")
    p.add_argument("--ranks", help="only these ranks, e.g. 0,2")
    p.add_argument("--force", action="store_true",
                   help="replace rank files of another layout in the output (removed first), or write rank files "
                   "beside the source checkpoint's own weights")
    add_json_flag(p, "what was written (files, sizes, sha256, plan)")
    add_progress_flags(p)
    p.set_defaults(func=cmd_write)
    _add_pull(sub)


def cmd_pull(args: argparse.Namespace) -> int:
    if args.meta:
        return _pull_meta(args)
    layout = layout_of(args)
    if args.rank is None:
        raise PlanError("reshard pull: give --rank (and the layout: --tp ...) for a rank's shard, or --meta -o DIR "
                        "(config and tokenizer)")
    layout.check_rank(args.rank)
    out = Path(args.out or rank_file_name(args.rank, layout.world))
    if is_service_url(args.url):
        from reshard.io.client.shard_client import ShardClient  # httpx only when pulling from the service

        with ShardClient(args.url, token=args.token, retries=args.retries, rules=args.rules, engine=args.engine) as client:
            result = client.pull(args.rank, layout if not layout.tp_only else layout.tp, out, progress=args.progress,
                                 resume=not args.no_resume)
    else:
        result = pull_here(args.url, args.rank, layout, out, args)
    if args.json:
        print_json({**result, "tp": layout.tp, "layout": layout.sizes()})
        return 0
    if result.get("kept"):
        print(f"rank {args.rank} of {layout.describe()} is already in place: {human(result['size'])}, "
              f"sha256 {result['sha256'][:16]}... verified, nothing downloaded -> {result['path']}")
        return 0
    resumed = f", resumed at {human(result['resumed_from'])}" if result["resumed_from"] else ""
    print(f"pulled rank {args.rank} of {layout.describe()}: {human(result['size'])}{resumed}, "
          f"sha256 {result['sha256'][:16]}... -> {result['path']}")
    return 0


def _pull_meta(args: argparse.Namespace) -> int:
    if not args.out:
        raise PlanError("reshard pull --meta: give the directory to copy the files into with -o DIR")
    if is_service_url(args.url):
        from reshard.io.client.shard_client import ShardClient

        with ShardClient(args.url, token=args.token, retries=args.retries) as client:
            files = client.pull_meta(args.out)
    else:
        files = meta_here(args.url, Path(args.out))
    if args.json:
        print_json({"out": str(args.out), "files": files})
        return 0
    names = ", ".join(f["name"] for f in files) or "none"
    print(f"pulled {len(files)} small files ({names}) -> {args.out}")
    return 0


def _add_pull(sub: Any) -> None:
    p = command(sub, "pull", help="one rank's shard into a file: downloaded from `reshard serve` (resumable, verified), "
                "or cut here from a path or store", examples_=(
                    "reshard pull http://127.0.0.1:8000/v1/checkpoints/llama --tp 4 --rank 1",
                    "reshard pull http://127.0.0.1:8000/v1/checkpoints/llama --tp 4 --rank 1 -o shards/rank1.safetensors",
                    "reshard pull http://127.0.0.1:8000/v1/checkpoints/llama --meta -o model-files/",
                    "reshard pull ckpt/ --tp 2 --rank 0 --json"))
    p.add_argument("url", metavar="checkpoint", help=SOURCE_HELP)
    p.add_argument("--rank", type=int, help="global rank, 0..world-1")
    add_layout_flags(p)
    p.add_argument("--meta", action="store_true",
                   help="instead of a shard: the checkpoint's config.json, tokenizer and generation config into -o DIR")
    p.add_argument("--engine", choices=known_engines(), help="a shard cut the way an engine holds it (docs/vllm.md)")
    p.add_argument("-o", "--out", help="output file (default rank-RRRRR-of-WWWWW.safetensors; its folder is made, with its "
                   "parents, if missing, as `write -o` makes its own); with --meta a directory")
    p.add_argument("--token", help="bearer token (default $RESHARD_TOKEN)")
    p.add_argument("--rules", help="from the service: the label of a manifest stored there; else a rules file")
    p.add_argument("--retries", type=int, default=5, help="tries after a failure without progress (default 5), "
                   "each announced on stderr")
    p.add_argument("--no-resume", action="store_true", help="ignore a partial download left by an earlier try")
    add_json_flag(p)
    add_progress_flags(p)
    p.set_defaults(func=cmd_pull)

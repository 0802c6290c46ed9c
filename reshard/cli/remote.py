"""The commands over either kind of source: the service's checkpoint URL, or what `open_source` opens.

Every command that takes a checkpoint takes the service's URL (`http://HOST:PORT/v1/checkpoints/NAME`),
a store URL (`s3://`, `gs://`, `hf://`, `http(s)://` static) or a local path:
- from the service, the service plans and cuts: `plan` asks for its plan, `write` pulls every rank's
  shard (each verified against the service's sha256) with the small files and records them in
  `reshard.json`, `merge` pulls the tp=1 shard (every tensor whole) and merges it, `pull` pulls one rank;
- from a path or store, reshard plans and cuts here: `pull` writes one rank's file as `write --ranks R`
  would, atomically, to the file named.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
from pathlib import Path
from typing import Any

from reshard.errors import OutputPathError, PlanError
from reshard.format.rank_file import rank_file_name
from reshard.io.client.wire import is_checkpoint_url
from reshard.io.outfs import fsync_dir, made_dir, output_errors, write_json_atomic
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.sinks.target import check_target, remove_names
from reshard.io.sinks.writer import MANIFEST_NAME, pulled_record, write_files
from reshard.io.source.opener import open_source
from reshard.io.source.remote_dir import copy_meta_files, meta_files_at
from reshard.io.source.schemes import check_scheme
from reshard.io.source.stores import is_url
from reshard.layout.mesh import Layout
from reshard.plan.planner import make_plan

__all__ = ["is_service_url", "merge_from_service", "meta_here", "plan_from_service", "pull_here", "write_from_service"]


def is_service_url(spec: Any) -> bool:
    """Whether `spec` names the service: its checkpoint URL, or an http(s) URL through `/v1/checkpoints/` that
    is not quite one (`ShardClient` then says what is wrong with it, rather than a static server's 404)."""
    return is_checkpoint_url(spec) or (isinstance(spec, str) and spec.lower().startswith(("http://", "https://"))
                                       and "/v1/checkpoints/" in spec)


def _client(url: str, args: argparse.Namespace, *, rules: bool = True) -> Any:
    from reshard.io.client.shard_client import ShardClient  # httpx only when the service is asked

    return ShardClient(url, token=getattr(args, "token", None), retries=getattr(args, "retries", 5),
                       rules=getattr(args, "rules", None) if rules else None, engine=getattr(args, "engine", None))


def _want(layout: Layout) -> int | Layout:
    return layout.tp if layout.tp_only else layout


def plan_from_service(url: str, layout: Layout, args: argparse.Namespace, *, tensors: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the checkpoint's description, the plan of `layout`) as the service gives them (`--rules` is a label
    of a manifest stored there)."""
    with _client(url, args) as client:
        return client.info(), client.plan(_want(layout), tensors=tensors)


def write_from_service(url: str, layout: Layout, out: str, args: argparse.Namespace, *,
                       ranks: list[int] | None = None) -> dict[str, Any]:
    """Pull the rank files of `layout` (or `ranks` of it) into the directory `out`, with the checkpoint's small
    files and `reshard.json`; the record, with `kept` and `written` (ranks) as `write_shards` gives them."""
    check_scheme(out)
    if is_url(out):
        raise OutputPathError(f"-o {out}: from the service, `reshard write` writes into a local folder; write from "
                              "the checkpoint's own path or store URL to write into a store")
    stale = check_target(out, layout, force=args.force)
    wanted = ranks if ranks is not None else list(range(layout.world))
    for r in wanted:
        layout.check_rank(r)
    with _client(url, args) as client:
        plan = client.plan(_want(layout), tensors=False)
        info = client.info()
        files, kept, written = {}, [], []
        with made_dir(out) as where:
            remove_names(where, stale)
            for r in wanted:
                name = rank_file_name(r, layout.world)
                got = client.pull(r, _want(layout), where / name, progress=args.progress)
                files[name] = {"rank": r, "size": got["size"], "sha256": got["sha256"]}
                (kept if got["kept"] else written).append(r)
            client.pull_meta(where)
            (where / "trainer_state.json").unlink(missing_ok=True)  # a training state vouches for other files
            record = pulled_record(files, plan=plan, source_url=client.url, config=info.get("config"))
            with output_errors(where):
                write_json_atomic(where / MANIFEST_NAME, record)
                fsync_dir(where)
    return {**record, "kept": kept, "written": written}


def merge_from_service(url: str, out: str, args: argparse.Namespace) -> dict[str, Any]:
    """The service's checkpoint as an ordinary HF checkpoint in `out`: its tp=1 shard (every tensor whole)
    and small files are pulled beside `out` (resumable), merged, then removed."""
    pulled = Path(out).parent / f".{Path(out).name}.reshard-pull"
    with _client(url, args, rules=False) as client:
        client.pull(0, 1, pulled / rank_file_name(0, 1), progress=args.progress)
        client.pull_meta(pulled)
    summary = merge(pulled, out, max_file_bytes=args.max_file_bytes, progress=args.progress)
    with contextlib.suppress(OSError):
        shutil.rmtree(pulled)
    return summary


def pull_here(source: str, rank: int, layout: Layout, dest: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Rank `rank` of `layout` cut here from a path or store URL into the file `dest`, atomically (the bytes
    the service would send for it, and `write --ranks RANK` would write)."""
    ckpt, manifest = open_source(source, rules=args.rules, engine=args.engine)
    plan = make_plan(ckpt, manifest, layout, ranks=[rank])
    rp = plan.ranks[0]
    with made_dir(dest.parent, for_file=dest):
        if dest.is_dir():
            raise OutputPathError(f"{dest}: is a directory; give the file to write, e.g. {dest / rank_file_name(rank, layout.world)}")
        sha = write_files([(rp, dest, lambda digest: None)], retry="run the same pull again")[0]
        fsync_dir(dest.parent)
    return {"path": str(dest), "rank": rank, "size": rp.size, "sha256": sha, "resumed_from": 0, "kept": False,
            "plan": plan.digest}


def meta_here(source: str, dest: Path) -> list[dict[str, Any]]:
    """The small files (config, tokenizer) of a path or store URL's checkpoint copied into `dest`."""
    ckpt, _ = open_source(source)
    if not meta_files_at(ckpt.root):
        raise PlanError(f"{source}: no config.json or tokenizer files beside the weights to copy")
    with made_dir(dest, for_file=dest / "config.json"), output_errors(dest):
        names = copy_meta_files(ckpt.root, dest)
        fsync_dir(dest)
    return [{"name": n, "size": (dest / n).stat().st_size} for n in names]

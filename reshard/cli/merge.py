"""`reshard merge SHARDS -o OUT [--optimizer]`: rank shards back to a full HF checkpoint, and with
`--optimizer` a training checkpoint's AdamW moments to `OUT/optimizer/SLOT/` (`reshard.io.sinks.hf_checkpoint`).
The small files beside the shards (config.json, generation config, tokenizer files) are copied along.
From the service's checkpoint URL, the service's checkpoint is pulled whole and merged (`reshard.cli.remote`)."""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli.common import add_json_flag, command, print_json
from reshard.cli.remote import is_service_url, merge_from_service
from reshard.errors import PlanError
from reshard.io.progress import add_progress_flags, human
from reshard.io.sinks.hf_checkpoint import DEFAULT_MAX_FILE, merge
from reshard.layout.mesh import Layout


def cmd_merge(args: argparse.Namespace) -> int:
    if is_service_url(args.shards):
        if args.optimizer:
            raise PlanError(f"{args.shards}: --optimizer merges a local (or store) training checkpoint's optimizer/; "
                            "from the service, pull its rank files with `reshard write URL ... -o DIR` first")
        summary = merge_from_service(args.shards, args.out, args)
    else:
        summary = merge(args.shards, args.out, max_file_bytes=args.max_file_bytes, progress=args.progress,
                        optimizer=args.optimizer)
    if args.json:
        print_json({"out": str(args.out), **summary})
    else:
        print(f"merged {summary['tensors']} tensors from {Layout.from_sizes(summary['layout']).describe()} shards into {args.out} "
              f"({human(summary['bytes'])} in {len(summary['files'])} file(s)), with {', '.join(summary['kept']) or 'no other files'}")
        for slot, got in summary.get("optimizer", {}).items():
            print(f"merged the optimizer's {slot} of {got['tensors']} parameters into {args.out}/{got['dir']} "
                  f"({human(got['bytes'])} in {len(got['files'])} file(s))")
    return 0


def add_commands(sub: Any) -> None:
    p = command(sub, "merge", help="merge a directory of rank shards back into a full HF checkpoint", examples_=(
        "reshard merge shards/ -o merged/",
        "reshard merge trained/ -o merged/ --optimizer        # a training checkpoint, AdamW's moments too",
        "reshard merge s3://bucket/llama-tp4/ -o merged/ --json",
        "reshard merge http://127.0.0.1:8000/v1/checkpoints/llama -o merged/   # the service's checkpoint, whole"))
    p.add_argument("shards", metavar="checkpoint",
                   help="directory (or s3:// / gs:// prefix) of rank-XXXXX-of-YYYYY.safetensors files, or the "
                   "service's checkpoint URL http://HOST:PORT/v1/checkpoints/NAME")
    p.add_argument("-o", "--out", required=True, help="output checkpoint directory (made, with its parents, if missing)")
    p.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE,
                   help="start a new model-XXXXX-of-YYYYY file past this many bytes (default 5e9)")
    p.add_argument("--optimizer", action="store_true",
                   help="a training checkpoint: also merge AdamW's moments, under the parameters' names, into "
                   "OUT/optimizer/exp_avg/ and OUT/optimizer/exp_avg_sq/ (HF-shaped, like the weights)")
    p.add_argument("--token", help="the service's bearer token (default $RESHARD_TOKEN)")
    add_json_flag(p, "a summary (files, tensors, bytes, layout, the small files kept)")
    add_progress_flags(p)
    p.set_defaults(func=cmd_merge)

"""`reshard merge SHARDS -o OUT [--optimizer]`: rank shards (or a torch DCP checkpoint) back to a full HF
checkpoint, and with `--optimizer` a training checkpoint's AdamW moments to `OUT/optimizer/SLOT/`
(`reshard.io.sinks.hf_checkpoint`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from reshard.io.progress import add_progress_flags, human
from reshard.io.sinks.hf_checkpoint import DEFAULT_MAX_FILE, merge
from reshard.layout.mesh import Layout

_SOURCES = {"dcp": "the DCP checkpoint (.metadata and .distcp files)",
            "dcp-safetensors": "the DCP checkpoint (HuggingFaceStorageWriter's shard files)"}


def cmd_merge(args: argparse.Namespace) -> int:
    summary = merge(args.shards, args.out, max_file_bytes=args.max_file_bytes, progress=args.progress,
                    optimizer=args.optimizer)
    if args.json:
        print(json.dumps(summary))
    else:
        what = f"{Layout.from_sizes(summary['layout']).describe()} shards" if "layout" in summary else \
            _SOURCES[summary["source"]]
        print(f"merged {summary['tensors']} tensors from {what} into {args.out} "
              f"({human(summary['bytes'])} in {len(summary['files'])} file(s))")
        if summary.get("left_out"):
            print(f"left out {len(summary['left_out'])} entries that are not the model's tensors, e.g. {summary['left_out'][0]!r}")
        for slot, got in summary.get("optimizer", {}).items():
            print(f"merged the optimizer's {slot} of {got['tensors']} parameters into {args.out}/{got['dir']} "
                  f"({human(got['bytes'])} in {len(got['files'])} file(s))")
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("merge", help="merge a directory of rank shards, or a torch DCP checkpoint, into a full HF checkpoint")
    p.add_argument("shards", help="directory (or s3:// / gs:// prefix) of rank-XXXXX-of-YYYYY.safetensors files, or of "
                   "a DCP checkpoint (.metadata + .distcp files, or shard-XXXXX-model-XXXXX-of-XXXXX.safetensors files)")
    p.add_argument("-o", "--out", required=True, help="output checkpoint directory")
    p.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE,
                   help="start a new model-XXXXX-of-YYYYY file past this many bytes (default 5e9)")
    p.add_argument("--optimizer", action="store_true",
                   help="a training checkpoint: also merge AdamW's moments, under the parameters' names, into "
                   "OUT/optimizer/exp_avg/ and OUT/optimizer/exp_avg_sq/ (HF-shaped, like the weights)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_progress_flags(p)
    p.set_defaults(func=cmd_merge)

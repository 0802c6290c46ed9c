"""The `reshard` command: plan | write | merge | pull | serve | demo.

Each subcommand module of this package registers itself through `add_commands(sub)`; this file
only dispatches and turns a `ReshardError` (or a stray `OSError`) into one line on stderr
and exit status 1; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from reshard.cli import commands, demo, merge, serve
from reshard.errors import ReshardError

# modules that define `add_commands(subparsers)`; each command sets `func(args) -> int`
COMMAND_MODULES = (commands, merge, serve, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description="Per-rank tensor-parallel shards of safetensors checkpoints.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ReshardError as e:
        if args.debug:
            raise
        print(f"reshard: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # one the command did not type (an output error is typed where it happens)
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"reshard: error: {where}{e.strerror or e}; run with --debug for the traceback", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("reshard: interrupted", file=sys.stderr)
        return 130


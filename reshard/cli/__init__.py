# PYTHON_ARGCOMPLETE_OK
"""The `reshard` command: plan | write | merge | pull | serve | demo | launch | completion.

Each subcommand module of this package registers itself through `add_commands(sub)`; this file
only dispatches and turns a `ReshardError` (or a stray `OSError`, or a missing optional package) into
one line on stderr and exit status 1; `--debug`, anywhere on the line, shows the traceback instead.
The flags every command shares (`--debug`, `--log-level`, `--json`, `--version`) are `reshard.cli.common`'s.
SIGINT and SIGTERM stop a command the same way: the first one raises `Interrupted` (a
`KeyboardInterrupt`) in the main thread, so what is being written is cleaned up as on any failure
(temp files removed, multipart uploads aborted), and the command exits 128 + the signal number with
one line; a signal that arrives during that cleanup is ignored. `serve` has its own graceful shutdown (uvicorn's) and keeps it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from importlib import import_module
from typing import Any

from reshard import enable_import_cache
from reshard.cli.common import HelpFormatter, VersionAction, add_common_flags, setup_logging
from reshard.errors import EXTRA_OF, ReshardError, missing_dependency

# reshard's numpy gathers bytes and does no linear algebra: no OpenBLAS thread pool, whose threads spin for
# a while once started and would take a core from the command (unless the user set it)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# modules of this package that define `add_commands(subparsers)`, imported when the parser is built; each
# command sets `func(args) -> int`
COMMAND_MODULES = ("commands", "merge", "serve", "demo", "launch", "completion")
OWN_SIGNALS = frozenset({"serve", "launch"})  # commands that install their own SIGTERM/SIGINT handling
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the command stops, cleaning up as on any failure."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the first SIGINT or SIGTERM raises `Interrupted`; later ones are ignored (they
    would cut the cleanup short). Only the main thread may set handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    stopping = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise Interrupted(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)  # None: set outside Python


EPILOG = """examples:
  reshard plan ckpt/ --tp 4                          # what every rank file of tp=4 holds, from headers alone
  reshard write ckpt/ --tp 4 -o shards/              # the rank files, atomically
  reshard merge shards/ -o merged/                   # back to an ordinary HF checkpoint
  reshard serve --root checkpoints/                  # rank shards over HTTP
  reshard pull http://HOST:8000/v1/checkpoints/NAME --tp 4 --rank 1
  reshard COMMAND --help                             # a command's flags and examples

A checkpoint is a local path, a store URL (s3://, gs://, hf://, http(s):// static) or the service's
checkpoint URL (http://HOST:PORT/v1/checkpoints/NAME), for every command that takes one."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description="Per-rank tensor-parallel shards of safetensors checkpoints.",
                                     epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("--version", action=VersionAction)
    add_common_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        import_module(f"reshard.cli.{name}").add_commands(sub)
    return parser


def subcommand(argv: Sequence[str]) -> str | None:
    """The command word of `argv` (the first word that is no flag, past `--log-level LEVEL`)."""
    it = iter(argv)
    for word in it:
        if word == "--log-level":
            next(it, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    enable_import_cache()  # a command that imports transformers (empty_tp_model, vLLM) does not read its source tree
    argv = list(sys.argv[1:] if argv is None else argv)
    if subcommand(argv) == "launch":  # the ranks it forks inherit what is imported: not the other commands' modules
        from reshard.cli.launch import main as launch

        at = argv.index("launch")
        return launch(argv[:at] + argv[at + 1:])  # flags before the word (--debug, --log-level) are launch's too
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (`reshard completion bash`): answer and exit
        import argcomplete

        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    with contextlib.nullcontext() if args.command in OWN_SIGNALS else stop_on_signals():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # stdout's reader left (`reshard plan ... --json | head`): as other tools, quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        return 128 + signal.SIGPIPE
    except ModuleNotFoundError as e:  # an optional package a command needs (torch, transformers)
        if args.debug or e.name not in EXTRA_OF:  # anything else is a broken install: its traceback says which
            raise
        print(f"reshard: error: {missing_dependency(e.name, f'reshard {args.command}')}", file=sys.stderr)
        return 1
    except ReshardError as e:
        if args.debug:
            raise
        print(f"reshard: error: {e}", file=sys.stderr)
        return int(getattr(e, "exit_status", 1))
    except OSError as e:  # one the command did not type (an output error is typed where it happens)
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"reshard: error: {where}{e.strerror or e}; run with --debug for the traceback", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # cleaned up on the way here, as on any failure
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"reshard: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum

"""What every `reshard` command shares: `--debug`, `--log-level` and `--json` accepted anywhere on the
line, diagnostics through logging on stderr, results on stdout, `--version`, examples in `--help`.

    reshard plan ckpt --tp 2 --debug          # the same as `reshard --debug plan ckpt --tp 2`
    reshard write ckpt --tp 2 -o out --json   # one JSON object on stdout, nothing else there

Results (what a command reports: a plan, the files written) go to stdout, as text or, with `--json`,
one JSON document; everything else (warnings, retries, progress bars, errors) goes to stderr, through
the `reshard` logger whose level `--log-level` sets (default `warning`).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from importlib import metadata
from typing import Any

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # trace: uvicorn's, debug elsewhere
DEFAULT_LOG_LEVEL = "warning"
log = logging.getLogger("reshard")
# what `--version` reports besides reshard itself: the libraries it works with, as installed (never imported)
VERSION_OF = ("torch", "transformers", "safetensors", "numpy", "fastapi", "uvicorn", "httpx", "obstore", "vllm")


def add_common_flags(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    """`--debug` and `--log-level` on `p`; on a subcommand their default is left to the top parser, so
    either place on the line sets them."""
    g = p.add_argument_group("common options")
    g.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="show the traceback of an error instead of its one line")
    g.add_argument("--log-level", choices=LOG_LEVELS, default=None if top else argparse.SUPPRESS, type=str.lower,
                   help=f"diagnostics shown on stderr from this level up (default {DEFAULT_LOG_LEVEL}; `serve`: "
                   "uvicorn's level, default info)")


def add_json_flag(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON object on stdout")


def examples(*lines: str) -> str:
    """An argparse epilog: `examples:` and the command lines, indented (a RawDescriptionHelpFormatter keeps them)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's wrapping, but for the examples and for text laid out by hand (lines indented, as in a
    module docstring), which keep their lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:") or "\n    " in text or "\n  " in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def command(sub: Any, name: str, *, help: str, description: str | None = None, examples_: tuple[str, ...] = ()
            ) -> argparse.ArgumentParser:
    """A subcommand parser with the common flags and its examples at the end of `--help`."""
    p = sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".",
                       epilog=examples(*examples_) if examples_ else None,
                       formatter_class=HelpFormatter)
    add_common_flags(p)
    return p


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """`reshard: warning: ...` lines on whatever `sys.stderr` is when a record is emitted."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def format(self, record: logging.LogRecord) -> str:
        return f"reshard: {record.levelname.lower()}: {record.getMessage()}"


def setup_logging(level: str | None) -> None:
    """The `reshard` logger's lines (`reshard: warning: ...`) on stderr from `level` up (None: warning)."""
    level = level or DEFAULT_LOG_LEVEL
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        log.addHandler(_Stderr())
    log.setLevel(logging.DEBUG if level == "trace" else getattr(logging, level.upper()))


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    print()


def installed(name: str) -> str | None:
    """The installed version of distribution `name`, None when it is not installed (nothing imported)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_text() -> str:
    """`reshard --version`: reshard, Python and platform, and the libraries it sees, as `hf env` lists them."""
    from reshard import __version__

    lines = [f"reshard {__version__}",
             f"python {platform.python_version()} ({sys.executable})", f"platform {platform.platform()}"]
    lines += [f"{name} {installed(name) or 'not installed'}" for name in VERSION_OF]
    return "\n".join(lines)


class VersionAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show reshard's version and those of torch, transformers and the libraries it uses, "
                         "then exit", **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        print(version_text())
        parser.exit()


__all__ = ["LOG_LEVELS", "add_common_flags", "add_json_flag", "command", "examples", "log", "print_json",
           "setup_logging", "version_text"]

"""`python -m bench list` and `python -m bench NAME [ARGS]`: every comparison and tool of bench/ from one
entry point (bench/README.md says what each compares and where its results go).

`python -m bench NAME ARGS` is `python -m bench.MODULE ARGS`: it calls that module's `main(ARGS)`. The three
comparisons that only run inside the suite (`serve`, `train`, `plan`: no `main` of their own) run as
`python -m bench --only NAME ARGS`. Anything else (`python -m bench [--full] [--only ...]`) is the suite.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# NAME -> module of bench/: one entry a compare_*.py file (tests/test_bench_smoke.py checks), then the tools
COMMANDS = {
    "write": "compare_write",
    "serve": "compare_serve",
    "train": "compare_train",
    "plan": "compare_plan",
    "fill": "compare_fill",
    "link": "compare_link",
    "direct": "compare_direct",
    "store_serve": "compare_store_serve",
    "s3_write": "compare_s3_write",
    "stores": "compare_stores",
    "vllm": "compare_vllm",
    "checkpoint": "compare_checkpoint",
    "dcp_merge": "compare_dcp_merge",
    "serve_options": "serve_options",
    "gather": "gather",
    "profile_write": "profile_write",
    "fill_phases": "fill_phases",
    "trainer_support": "trainer_support",
}


def summary(module: str) -> str:
    """The first line of `bench/MODULE.py`'s docstring, read without importing it (some import torch or vLLM)."""
    doc = ast.get_docstring(ast.parse((BENCH / f"{module}.py").read_text(encoding="utf-8"))) or ""
    return doc.split("\n", 1)[0]


def listing() -> str:
    rows = [f"{name:<16} python -m bench.{module:<20} {summary(module)}" for name, module in COMMANDS.items()]
    return "\n".join(["python -m bench NAME [ARGS]:", *rows])


def dispatch(argv: list[str]) -> int:
    """Run `argv` (the arguments after `python -m bench`): `list`, a NAME of COMMANDS, or the suite."""
    from bench import run

    if argv[:1] == ["list"]:
        print(listing())
        return 0
    if not argv or argv[0].startswith("-"):
        return run.main(argv)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        raise SystemExit(f"python -m bench: no command {name!r}; known: list, {', '.join(COMMANDS)}")
    main = getattr(importlib.import_module(f"bench.{COMMANDS[name]}"), "main", None)
    if main is None:  # a comparison of the suite only
        return run.main(["--only", name, *rest])
    code = main(rest)
    return code if isinstance(code, int) else 0

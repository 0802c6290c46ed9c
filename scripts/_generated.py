"""Shared by the generator scripts: write a generated file, or with --check say whether it is current."""

from __future__ import annotations

from pathlib import Path


def write_or_check(path: Path, text: str, *, check: bool, done: str) -> int:
    """Write `text` to `path` (printing `done`), or with `check` exit status 1 when the file differs."""
    if check:
        same = path.read_text(encoding="utf-8") == text
        print(f"{path.name} is up to date" if same else f"{path} differs from what the script generates; rerun it")
        return 0 if same else 1
    path.write_text(text, encoding="utf-8")
    print(done)
    return 0

"""`cache_dir(name)`: where reshard keeps what it can recompute (this user's cache, not the checkpoint's)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str, configured: str = "") -> Path:
    """`configured` (a settings field, e.g. `verified_dir`) where it is set, else `$XDG_CACHE_HOME/reshard/NAME`
    (default `~/.cache/reshard/NAME`)."""
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "reshard" / name

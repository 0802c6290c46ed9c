"""`cache_dir(name)`: where reshard keeps what it can recompute (this user's cache, not the checkpoint's)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str, *, env: str | None = None) -> Path:
    """`$ENV` where that variable is set, else `$XDG_CACHE_HOME/reshard/NAME` (default `~/.cache/reshard/NAME`)."""
    if env and os.environ.get(env):
        return Path(os.environ[env])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "reshard" / name

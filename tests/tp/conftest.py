"""Make `tests/_dist.py` importable as `_dist` (spawned ranks inherit this sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

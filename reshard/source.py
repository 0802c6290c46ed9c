"""Moved to `reshard.sources` (local paths and store URLs); kept for existing imports."""

from reshard.sources import open_source

__all__ = ["open_source"]

"""The reshard HTTP service: rank shards of the checkpoints under a root, computed on the fly.

`create_app` and `Settings` are imported on first use, so `reshard --help` stays fast.
"""

from typing import Any

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from reshard.service.api.app import create_app

        return create_app
    if name == "Settings":
        from reshard.service.serve_settings import Settings

        return Settings
    raise AttributeError(name)

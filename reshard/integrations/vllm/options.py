"""`model_loader_extra_config` of load_format="reshard", checked before anything is loaded (no vLLM import)."""

from __future__ import annotations

from typing import Any

from reshard.errors import ReshardError

KEYS = ("url", "shards", "token", "rules")


def loader_options(extra: dict[str, Any] | None) -> dict[str, Any]:
    """`model_loader_extra_config`, checked: exactly one of `url`, `shards`; optional `token`, `rules`."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ReshardError(f"load_format='reshard': model_loader_extra_config has unknown keys {unknown}; "
                           f"known: {', '.join(KEYS)}")
    if ("url" in extra) == ("shards" in extra):
        raise ReshardError("load_format='reshard': model_loader_extra_config needs exactly one of "
                           "{'url': 'http://HOST:PORT/v1/checkpoints/NAME'} (the service) or {'shards': DIR} "
                           "(rank files of `reshard write --engine vllm`)")
    for key in KEYS:
        if key in extra and not isinstance(extra[key], str):
            raise ReshardError(f"load_format='reshard': model_loader_extra_config[{key!r}] must be a string, "
                               f"got {extra[key]!r}")
    return extra

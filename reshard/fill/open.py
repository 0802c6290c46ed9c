"""A rank's shard as a byte stream: from a shard directory, one rank file, or the service's URL.

`open_rank_stream` is how `fill_model` and the trainer reach their bytes; a URL is pulled with the
service client (only this rank's shard, streamed), a directory is read in chunks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError
from reshard.fill.stream import file_chunks
from reshard.format.checkpoint import CONFIG_NAME
from reshard.io.client import ShardClient
from reshard.io.shards import RANK_FILE
from reshard.io.stores import is_url
from reshard.io.writer import MANIFEST_NAME
from reshard.plan.types import rank_file_name


def open_rank_stream(
    source: str | Path, rank: int, tp: int, *, token: str | None = None, need_config: bool = True,
    rules: str | None = None, layout: str | None = None,
) -> tuple[dict[str, Any] | None, Iterator[Any], str | None, str]:
    """(config, byte chunks of this rank's file, expected sha256 or None, a name for errors).

    `source` is a shard directory, the service's checkpoint URL, or one rank file (whose own header
    says its rank and tp). The config is None only when absent and `need_config` is false; it is not
    fetched from a URL unless needed. `rules` (a stored label) and `layout` choose the service's cut."""
    if is_url(source):
        client = ShardClient(str(source), token=token, rules=rules, layout=layout)
        config = client.info().get("config") if need_config else None
        if need_config and not isinstance(config, dict):
            config = _no_config(f"{source}: the checkpoint has no config.json", need_config)
        return config, iter(client.iter_shard(rank, tp)), None, f"{source} rank {rank}/{tp}"
    path = Path(source)
    root = path.parent if path.is_file() else path
    if not path.is_file():
        path = root / rank_file_name(rank, tp)
    if not path.is_file():
        have = sorted({int(m.group(2)) for p in root.glob("rank-*") if (m := RANK_FILE.fullmatch(p.name))})
        raise CheckpointError(
            f"{root}: no {path.name} for tp={tp} (shards here are for tp={have or 'none'}); "
            f"run `reshard write {root} --tp {tp} -o DIR`"
        )
    config = json.loads((root / CONFIG_NAME).read_text()) if (root / CONFIG_NAME).is_file() \
        else _no_config(f"{root}: no config.json beside the rank files", need_config)
    sha = None
    if (root / MANIFEST_NAME).is_file():
        sha = json.loads((root / MANIFEST_NAME).read_text()).get("files", {}).get(path.name, {}).get("sha256")
    return config, file_chunks(path), sha, str(path)


def _no_config(what: str, need_config: bool) -> None:
    if need_config:
        raise CheckpointError(f"{what}; the trainer needs one")

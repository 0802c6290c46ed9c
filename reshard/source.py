"""Open what `reshard plan|write` and the service read: a source and the manifest that applies to it.

A source is a checkpoint (directory or .safetensors file) or a directory of rank shards (to reshard
tp=P -> tp=Q); both offer `global_tensors()`, `files`, `config`, `root` and `identity()`.
"""

from __future__ import annotations

import os
from pathlib import Path

from reshard.format import INDEX_NAME, SINGLE_NAME, Checkpoint
from reshard.manifest import Manifest, resolve_manifest
from reshard.shards import ShardSet, is_shard_dir


def open_source(
    path: str | os.PathLike[str], *, rules: str | Path | None = None
) -> tuple[Checkpoint | ShardSet, Manifest]:
    """Validate every header at `path` and resolve its manifest."""
    p = Path(path)
    if is_shard_dir(p) and not (p / SINGLE_NAME).exists() and not (p / INDEX_NAME).exists():
        shards = ShardSet.open(p)
        return shards, (Manifest.load(rules) if rules is not None else shards.manifest())
    ckpt = Checkpoint.open(p)
    return ckpt, resolve_manifest(ckpt.root, ckpt.config, list(ckpt.tensors), rules)

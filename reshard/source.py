"""Open what `reshard plan|write` and the service read: a checkpoint and the manifest that applies to it."""

from __future__ import annotations

import os
from pathlib import Path

from reshard.format import Checkpoint
from reshard.manifest import Manifest, resolve_manifest


def open_source(path: str | os.PathLike[str], *, rules: str | Path | None = None) -> tuple[Checkpoint, Manifest]:
    """Validate every header of the checkpoint at `path` and resolve its manifest."""
    ckpt = Checkpoint.open(path)
    manifest = resolve_manifest(ckpt.root, ckpt.config, list(ckpt.tensors), rules)
    return ckpt, manifest

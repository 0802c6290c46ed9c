"""Open what `reshard plan|write|merge` and the service read: a source and the manifest that applies to it.

A source is a checkpoint (directory or .safetensors file), a directory of rank shards (to reshard
tp=P -> tp=Q) or a torch DCP checkpoint (`reshard.io.source.dcp_dir`: `dcp.save`'s `.metadata` and
`.distcp` files, or HuggingFaceStorageWriter's shard files); all offer `global_tensors()`, `files`,
`config`, `root` and `identity()`. A source is a local path or a URL (`s3://BUCKET/PREFIX`, `gs://...`,
`http(s)://HOST/PATH/`, `hf://ORG/MODEL`): `reshard.io.source.remote_dir.RemoteDirectory` gives the same
`Directory` view of a store prefix, and `reshard.io.source.readers` the same stream reads, so plan, stream,
writer and service do not know where the bytes come from.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from reshard.errors import CheckpointError, ManifestError
from reshard.format.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint, LocalDirectory
from reshard.io.source.dcp_dir import DcpCheckpoint, dcp_kind
from reshard.io.source.rank_dir import ShardSet, has_rank_files, is_shard_dir
from reshard.io.source.remote_dir import RemoteDirectory
from reshard.io.source.schemes import check_scheme
from reshard.io.source.stores import RemotePath, is_url
from reshard.rules.engines import apply_engine
from reshard.rules.from_config import RULES_FILES, from_config, resolve_manifest
from reshard.rules.manifest import Manifest

__all__ = ["checkpoint_manifest", "open_checkpoint", "open_pieces", "open_shards", "open_source", "open_tensors"]
Opened = Checkpoint | ShardSet | DcpCheckpoint


def open_source(
    path: str | os.PathLike[str], *, rules: str | Path | None = None, engine: str | None = None
) -> tuple[Opened, Manifest]:
    """Validate every header at `path` (a local path or a URL) and resolve its manifest, adjusted for an
    `engine` (`reshard.rules.engines`: "vllm") when one is named."""
    source, manifest = _open_source(path, rules)
    return source, apply_engine(manifest, engine, list(source.global_tensors()) if engine else (),
                                getattr(source, "config", None))


def open_tensors(path: str | os.PathLike[str]) -> Opened:
    """The source at `path` (local or a URL) with every header validated and no manifest resolved: a
    checkpoint, a directory of rank shards or a DCP checkpoint (what a reader that names its own boxes needs)."""
    return _tensors(path)[0]


def _tensors(path: str | os.PathLike[str]) -> tuple[Opened, RemoteDirectory | None]:
    """(the source, the remote directory it is in, None for a local one)."""
    check_scheme(path)
    if is_url(path):
        d = _remote_dir(str(path))
        names = d.names()
        if has_rank_files(names) and SINGLE_NAME not in names and INDEX_NAME not in names:
            return ShardSet.open(d), d
        if dcp_kind(d, names):
            return DcpCheckpoint.open(d), d
        return Checkpoint.from_directory(d), d
    p = Path(path)
    if is_shard_dir(p) and not (p / SINGLE_NAME).exists() and not (p / INDEX_NAME).exists():
        return ShardSet.open(p), None
    if p.is_dir() and dcp_kind(LocalDirectory(p), LocalDirectory(p).names()):
        return DcpCheckpoint.open(p), None
    return Checkpoint.open(p), None


def _open_source(path: str | os.PathLike[str], rules: str | Path | None) -> tuple[Opened, Manifest]:
    source, d = _tensors(path)
    if isinstance(source, ShardSet):
        return source, (Manifest.load(rules) if rules is not None else source.manifest())
    if d is not None:
        return source, (Manifest.load(rules) if rules is not None else checkpoint_manifest(source, d))  # type: ignore[arg-type]
    return source, resolve_manifest(source.root, source.config, list(source.tensors), rules)


def _remote_dir(url: str):  # -> RemoteDirectory
    d = RemoteDirectory(url)
    if not d.exists():
        what = "nothing under this prefix" if d.can_list else \
            f"no {INDEX_NAME}, {SINGLE_NAME} or DCP .metadata there, and a plain HTTP server cannot list files"
        raise CheckpointError(f"{url}: no such checkpoint ({what})")
    return d


def checkpoint_manifest(ckpt: Checkpoint, d=None) -> Manifest:  # noqa: ANN001 (d: RemoteDirectory)
    """A checkpoint's own manifest: a rules file beside it, else its config.json (local or remote)."""
    if not isinstance(ckpt.root, RemotePath):
        return resolve_manifest(ckpt.root, ckpt.config, list(ckpt.tensors))
    if d is None:
        d = RemoteDirectory(ckpt.root.url)
    for name in RULES_FILES:
        if d.is_file(name):
            return _remote_manifest(d, name)
    if ckpt.config is None:
        raise ManifestError(f"{ckpt.root}: no --rules given, no {RULES_FILES[0]} and no config.json to derive a plan from")
    return from_config(ckpt.config, list(ckpt.tensors))


def _remote_manifest(d, name: str) -> Manifest:
    """A rules file beside a remote checkpoint, parsed as `Manifest.load` parses a local one."""
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / name
        local.write_bytes(d.read_bytes(name))
        try:
            manifest = Manifest.load(local)
        except ManifestError as e:
            raise ManifestError(str(e).replace(str(local), str(d.path(name)))) from None
    return dataclasses.replace(manifest, source=f"rules file {d.path(name)}")


def open_checkpoint(url: str | os.PathLike[str]) -> Checkpoint:
    """A plain checkpoint (not rank shards) at a local path or URL."""
    check_scheme(url)
    return Checkpoint.from_directory(_remote_dir(str(url))) if is_url(url) else Checkpoint.open(url)


def open_shards(url: str | os.PathLike[str]) -> ShardSet:
    """The rank shards at a local path or URL (a store that can list)."""
    check_scheme(url)
    return ShardSet.open(_remote_dir(str(url)) if is_url(url) else Path(url))


def open_pieces(url: str | os.PathLike[str]) -> ShardSet | DcpCheckpoint:
    """A source of tensors saved in pieces at a local path or URL: rank shards, or a DCP checkpoint."""
    check_scheme(url)
    d = _remote_dir(str(url)) if is_url(url) else LocalDirectory(Path(url))
    if not is_url(url) and not Path(url).is_dir():
        raise CheckpointError(f"{url}: no such directory")
    return DcpCheckpoint.open(d) if dcp_kind(d, d.names()) else ShardSet.open(d)



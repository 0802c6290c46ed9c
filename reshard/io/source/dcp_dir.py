"""A torch DCP checkpoint as a source: each global tensor is the chunks the ranks saved, read in place.

Two kinds of directory, local or under a URL (`reshard.io.source.remote_dir.RemoteDirectory`):

- `dcp.save`'s (FileSystemWriter; torchtitan's `step-N/`): `.metadata` (read without running it,
  `reshard.format.dcp_metadata`) and `__R_N.distcp` files whose items are `torch.save` archives
  (`reshard.io.source.dcp_items` finds each chunk's raw bytes) or, with `serialization_format=
  SAFETENSORS`, safetensors files;
- `HuggingFaceStorageWriter(save_distributed=True)`'s (transformers' `save_pretrained(...,
  distributed_checkpoint=True)`): `shard-RRRRR-model-XXXXX-of-NNNNN.safetensors` files placed by their
  `DCP_SHARDING_INFO` (`reshard.format.dcp_sharding`), no index; a store that can list is needed.

Each chunk becomes a `Piece` of its `GlobalTensor` (the bytes stay in the files, as for a directory of rank
files), after checking that the chunks tile the tensor. Names are the saved state dict's; a state dict
saved under a "model" key (`dcp.save({"model": sd, "optimizer": ...})`, as `planner_data` records) gives
its model's tensors under their own names and leaves the rest out (`left_out`). `config.json` beside
the files gives the manifest, as for a checkpoint.
"""

from __future__ import annotations

import bisect
import math
import os
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.checkpoint import (
    INDEX_NAME,
    SINGLE_NAME,
    Directory,
    FileInfo,
    GlobalTensor,
    LocalDirectory,
    Piece,
    PiecedSource,
    TensorInfo,
    _read_config,
)
from reshard.format.dcp_metadata import METADATA_NAME, DcpItem, DcpMetadata, read_metadata
from reshard.format.dcp_sharding import is_shard_file_name, sharding_info
from reshard.format.headers import DTYPE_SIZES
from reshard.io.source.dcp_items import chunk_starts
from reshard.io.source.remote_dir import RemoteDirectory

__all__ = ["DcpCheckpoint", "dcp_kind"]

WRAPPER = "model"  # the key a model's state dict is saved under in a training state, when it is


def dcp_kind(d: Directory, names: list[str] | None) -> str | None:
    """"dcp" (a `.metadata`), "dcp-safetensors" (shard files of HuggingFaceStorageWriter, and no HF index
    or model.safetensors) or None, from the directory's listing (`names`; None where it cannot list)."""
    if (METADATA_NAME in names) if names is not None else d.is_file(METADATA_NAME):
        return "dcp"
    if names and any(map(is_shard_file_name, names)) and INDEX_NAME not in names and SINGLE_NAME not in names:
        return "dcp-safetensors"
    return None


class DcpCheckpoint(PiecedSource):
    """A DCP checkpoint's tensors (`tensors`, by name), its files and config.json; a `Source`."""

    def __init__(self, root: Any, kind: str, files: list[FileInfo], tensors: dict[str, GlobalTensor],
                 config: dict[str, Any] | None, left_out: tuple[str, ...] = ()) -> None:
        self.root, self.kind, self.files, self.tensors, self.config = root, kind, files, tensors, config
        self.left_out = left_out

    @classmethod
    def open(cls, path: str | os.PathLike[str] | Directory) -> DcpCheckpoint:
        """The DCP checkpoint in a local directory or a `Directory` (a URL's)."""
        d = path if hasattr(path, "header") else LocalDirectory(Path(path))
        names = d.names()
        kind = dcp_kind(d, names)
        if kind is None:
            raise CheckpointError(f"{d.root}: not a DCP checkpoint (no {METADATA_NAME} and no "
                                  "shard-XXXXX-model-XXXXX-of-XXXXX.safetensors files)")
        return _open_saved(d) if kind == "dcp" else _open_sharded(d, names or [])


def _stats(d: Directory, names: list[str]) -> dict[str, FileInfo]:
    """FileInfo (size and mtime, or size and version in a store) of each file named."""
    if isinstance(d, RemoteDirectory):
        found = d.stat_files(tuple(names))
        missing = sorted(set(names) - set(found))
        if missing:
            raise CheckpointError(f"{d.path(missing[0])}: no such object (the DCP checkpoint names it)")
        return {n: FileInfo(d.path(n), found[n][0], 0, 0, {}, found[n][1]) for n in names}
    out = {}
    for n in names:
        try:
            st = os.stat(d.path(n))
        except OSError as e:
            raise CheckpointError(f"{d.path(n)}: cannot read: {e.strerror} (the DCP checkpoint names it)") from None
        out[n] = FileInfo(d.path(n), st.st_size, st.st_mtime_ns, 0)
    return out


def _open_saved(d: Directory) -> DcpCheckpoint:
    md = read_metadata(d.read_bytes(METADATA_NAME), where=str(d.path(METADATA_NAME)))
    rename, left_out = _names(md)
    items = [it for it in md.items.values() if it.fqn in rename]  # the files of what is left out are not read
    _refuse_transforms(d, items)
    names = sorted({it.file for it in items})
    stats = _stats(d, [METADATA_NAME, *names])
    starts = chunk_starts(d, stats, items, md.tensors)
    tensors = {}
    for fqn, name in sorted(rename.items(), key=lambda kv: kv[1]):
        t = md.tensors[fqn]
        pieces = [(c.offsets, c.sizes, stats[md.items[(fqn, c.offsets)].file].path, starts[(fqn, c.offsets)])
                  for c in t.chunks]
        tensors[name] = _global(name, t.dtype, t.shape, pieces, d.root)
    return DcpCheckpoint(d.root, "dcp", [stats[n] for n in [METADATA_NAME, *names]], tensors, _read_config(d),
                         (*left_out, *md.objects))


def _refuse_transforms(d: Directory, items: list[DcpItem]) -> None:
    for it in items:
        if it.transforms:
            raise CheckpointError(
                f"{d.path(it.file)}: item {it.fqn!r} was written through {', '.join(it.transforms)} (a stream "
                "transform: compression); reshard reads chunks in place by byte range and cannot read transformed "
                "ones. Save without `_extensions`, or load it with torch (`dcp_to_torch_save`) and save it again")


def _names(md: DcpMetadata) -> tuple[dict[str, str], tuple[str, ...]]:
    """fqn -> the name it is served as, and the tensors left out: a state dict saved under `WRAPPER`
    gives its own names, without the prefix; anything else keeps the flattened name."""
    wrapped = {f for f in md.tensors if len(md.paths.get(f, ())) >= 2 and md.paths[f][0] == WRAPPER}
    if not wrapped:
        return {f: f for f in md.tensors}, ()
    return {f: f[len(WRAPPER) + 1 :] for f in wrapped}, tuple(sorted(set(md.tensors) - wrapped))


def _open_sharded(d: Directory, names: list[str]) -> DcpCheckpoint:
    files, chunks = [], {}
    for name in sorted(filter(is_shard_file_name, names)):
        info, local = d.header(name)
        files.append(info)
        offsets = sharding_info(info.metadata, {n: t.shape for n, t in local.items()}, where=str(info.path))
        for tname, t in local.items():
            chunks.setdefault(tname, []).append((offsets[tname] if offsets else (0,) * len(t.shape), t))
    tensors = {}
    for tname, found in sorted(chunks.items()):
        dtypes = {t.dtype for _, t in found}
        if len(dtypes) > 1:
            raise CheckpointError(f"{d.root}: tensor {tname!r} is saved as {sorted(dtypes)} in different files")
        shape = tuple(max(o[i] + t.shape[i] for o, t in found) for i in range(len(found[0][1].shape)))
        tensors[tname] = _global(tname, found[0][1].dtype, shape,
                                 [(o, t.shape, t.file, t.start) for o, t in found], d.root)
    return DcpCheckpoint(d.root, "dcp-safetensors", files, tensors, _read_config(d))


def _global(name: str, dtype: str, shape: tuple[int, ...], chunks: list[tuple[Any, Any, Any, int]],
            where: Any) -> GlobalTensor:
    """The global tensor of `chunks` (offsets, sizes, file, byte start), checked to tile it exactly once
    (chunks saved twice, as replicas, are taken once; empty ones are dropped)."""
    seen: dict[tuple[Any, Any], Piece] = {}
    for offsets, sizes, file, start in [c for c in chunks if math.prod(c[1])] or chunks[:1]:
        key = (tuple(offsets), tuple(sizes))
        if key not in seen:
            info = TensorInfo(name, dtype, tuple(sizes), file, start, math.prod(sizes) * DTYPE_SIZES[dtype])
            seen[key] = Piece(info, tuple(((o, o + s),) for o, s in zip(offsets, sizes)))
    _check_tiles(name, shape, list(seen), where)
    return GlobalTensor(name, dtype, shape, tuple(seen.values()))


def _check_tiles(name: str, shape: tuple[int, ...], boxes: list[tuple[Any, Any]], where: Any) -> None:
    """`boxes` (offsets, sizes) cover `shape` and do not overlap (each compared with those that start
    before it ends in dim 0: few, for chunks split along any dim)."""
    covered, total = sum(math.prod(s) for _, s in boxes), math.prod(shape)
    if covered != total:
        raise CheckpointError(f"{where}: tensor {name!r} of shape {list(shape)}: its chunks cover {covered} of its "
                              f"{total} elements; the checkpoint is missing a rank's files")
    if not shape or len(boxes) < 2:
        return
    boxes = sorted(boxes)
    starts = [o[0] for o, _ in boxes]
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 : bisect.bisect_left(starts, oa[0] + sa[0])]:
            if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(oa, sa, ob, sb)):
                raise CheckpointError(f"{where}: tensor {name!r}: its chunks at {list(oa)} (size {list(sa)}) and at "
                                      f"{list(ob)} (size {list(sb)}) overlap; the checkpoint mixes two saves")

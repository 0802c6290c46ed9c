"""The safetensors side of torch DCP: `DCP_SHARDING_INFO`, where each tensor of a file sits in its global tensor.

torch's `HuggingFaceStorageWriter(save_distributed=True)` (what transformers' `save_pretrained(...,
distributed_checkpoint=True)` uses) writes each rank's chunks as `shard-RRRRR-model-XXXXX-of-NNNNN
.safetensors` files, and `FileSystemWriter(serialization_format=SAFETENSORS)` as `__R_N.distcp`; both put
in `__metadata__`:

    DCP_SHARDING_INFO   JSON: {tensor name: {"saved_offsets": [offset of the chunk in each dim]}}
    DCP_VERSION         "1.0"

torch's `HuggingFaceStorageReader` reads every `*.safetensors` of a folder this way: a tensor's global
size is the largest offset + size over its chunks, and a file whose metadata lacks the key holds its
tensors whole. `sharding_info` reads it back (validated); `sharding_metadata` writes it, and
`offsets_fragment` is the fast path to one tensor's JSON (`reshard.format.rank_file`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from reshard.errors import CheckpointError

__all__ = ["DCP_VERSION", "DCP_VERSION_KEY", "SHARD_FILE", "SHARDING_KEY", "is_shard_file_name", "offsets_fragment",
           "sharding_info", "sharding_metadata"]

SHARDING_KEY = "DCP_SHARDING_INFO"
DCP_VERSION_KEY = "DCP_VERSION"
DCP_VERSION = "1.0"
SHARD_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
_COMPACT = (",", ":")


def is_shard_file_name(name: str) -> bool:
    """A file `HuggingFaceStorageWriter(save_distributed=True)` writes: `shard-00001-model-00001-of-00001.safetensors`."""
    return SHARD_FILE.fullmatch(name) is not None


def offsets_fragment(offsets: Sequence[int]) -> str:
    """One tensor's value in `DCP_SHARDING_INFO`, as compact JSON: `{"saved_offsets":[0,128]}`."""
    return '{"saved_offsets":[' + ",".join(map(str, offsets)) + "]}"


def sharding_metadata(offsets: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """The `__metadata__` entries that place each tensor of a file (name -> offsets) in its global tensor."""
    return {SHARDING_KEY: json.dumps({n: {"saved_offsets": list(o)} for n, o in sorted(offsets.items())},
                                     separators=_COMPACT), DCP_VERSION_KEY: DCP_VERSION}


def sharding_info(metadata: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]], *, where: str) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offsets in its global tensor from a file's `__metadata__` (`shapes`: the file's tensors);
    None when it has no `DCP_SHARDING_INFO` (then torch takes every tensor as whole)."""
    raw = metadata.get(SHARDING_KEY)
    if raw is None:
        return None
    try:
        info: Any = json.loads(raw)
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: metadata {SHARDING_KEY} is not a JSON object")
    out = {}
    for name, shape in shapes.items():
        entry = info.get(name)
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(offsets, list) or len(offsets) != len(shape) or not all(type(o) is int and o >= 0 for o in offsets):
            raise CheckpointError(f"{where}: tensor {name!r} has no valid saved_offsets in {SHARDING_KEY} (got "
                                  f"{str(entry)[:100]}; expected {len(shape)} non-negative integers)")
        out[name] = tuple(offsets)
    return out

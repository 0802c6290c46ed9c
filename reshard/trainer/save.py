"""Save this rank's parameters as a rank shard in the same self-describing format `reshard write` makes."""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reshard.fill.into_params import RankHeader, byte_view
from reshard.format.checkpoint import CONFIG_NAME, DTYPE_SIZES, encode_header
from reshard.format.rank_file import RankPlace, encode_metadata, rank_file_name
from reshard.format.torch_side import DTYPE_NAMES
from reshard.io.outfs import atomic_file, check_space, output_errors, prepare_dir, write_json_atomic
from reshard.io.sinks.writer import MANIFEST_NAME
from reshard.plan.types import data_order
from reshard.trainer.names import shard_targets

RETRY = "train (or save) again"


def save_rank_shard(model: nn.Module, out_dir: str | Path, *, config: dict | None = None) -> Path:
    """Write `rank-R-of-T.safetensors` for this rank into `out_dir` (atomically), one tensor at a time.

    The file describes itself exactly as the shard the model was built from did, under the same names
    (per-expert MoE tensors are read back out of transformers' fused parameters), so `reshard merge`
    and `reshard write` read it with nothing else at hand. Rank 0 also writes config.json.
    """
    header: RankHeader = model.rank_header
    tensors = {name: t.detach() for name, t in shard_targets(model, header.tensors).items()}
    path = prepare_dir(out_dir) / rank_file_name(header.rank, header.layout.world)
    write_rank_file(path, header.place, header.tensors, tensors)
    out = path.parent
    if header.rank == 0:
        with output_errors(out, retry=RETRY):
            with contextlib.suppress(FileNotFoundError):
                (out / MANIFEST_NAME).unlink()  # an older record would no longer describe these files
            if config is not None:
                write_json_atomic(out / CONFIG_NAME, config)
    return path


def write_rank_file(path: Path, place: RankPlace, specs: Mapping[str, Mapping[str, Any]],
                    tensors: Mapping[str, torch.Tensor]) -> str:
    """Write `tensors` (described by `specs`, one entry each) as the rank file `path`, atomically and one
    tensor at a time; returns the file's sha256 (hex), computed as it is written."""
    order = sorted(tensors, key=lambda n: data_order(n, DTYPE_NAMES[tensors[n].dtype]))
    entries, pos = [], 0
    for name in order:
        t = tensors[name]
        n = math.prod(t.shape) * DTYPE_SIZES[DTYPE_NAMES[t.dtype]]
        entries.append((name, DTYPE_NAMES[t.dtype], tuple(t.shape), pos, pos + n))
        pos += n
    head = encode_header(encode_metadata(place, {n: specs[n] for n in tensors}), entries)
    check_space(path.parent, len(head) + pos, fix=f"free some space there or save elsewhere, then {RETRY}")
    sha = hashlib.sha256(head)
    with output_errors(path, retry=RETRY), atomic_file(path) as f:
        f.write(head)
        for name in order:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                f.write(view := byte_view(t))
                sha.update(view)
    return sha.hexdigest()


__all__ = ["save_rank_shard", "write_rank_file"]

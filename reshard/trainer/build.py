"""`build_model`: the checkpoint's own transformers model on meta -> parallelize -> to_empty -> fill.

The source is a directory written by `reshard write` (or saved by the trainer), or the service's URL
for a checkpoint (`http://HOST:PORT/v1/checkpoints/NAME`): then only this rank's shard is pulled,
and its bytes go straight into the materialized parameters as they arrive.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup

from reshard.errors import CheckpointError
from reshard.format import CONFIG_NAME
from reshard.plan import rank_file_name
from reshard.quant.dequant import Dequantizer
from reshard.shards import RANK_FILE
from reshard.tensors import TORCH_DTYPES
from reshard.tp.comm import tp_rank, tp_world_size
from reshard.trainer.adjust import install_gradient_sums
from reshard.trainer.fill import RankHeader, file_chunks, fill_parameters, read_header_from
from reshard.trainer.hf import hf_config, init_buffers, meta_model, retie, tied_pair
from reshard.trainer.names import shard_targets
from reshard.trainer.parallel import parallelize
from reshard.writer import MANIFEST_NAME


def is_url(source: str | Path) -> bool:
    return str(source).startswith(("http://", "https://"))


def open_rank_stream(
    source: str | Path, rank: int, tp: int, *, token: str | None = None, need_config: bool = True,
) -> tuple[dict[str, Any] | None, Iterator[Any], str | None, str]:
    """(config, byte chunks of this rank's file, expected sha256 or None, a name for errors).

    `source` is a shard directory, the service's checkpoint URL, or one rank file (whose own header
    says its rank and tp). The config is None only when absent and `need_config` is false."""
    if is_url(source):
        from reshard.client import ShardClient

        client = ShardClient(str(source), token=token)
        config = client.info().get("config")
        if not isinstance(config, dict):
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


def stored_dtype(header: RankHeader) -> torch.dtype:
    """The floating dtype holding most of the shard's bytes (what `--dtype keep` trains in)."""
    sizes: dict[str, int] = {}
    for e in header.entries.values():
        sizes[e["dtype"]] = sizes.get(e["dtype"], 0) + e["data_offsets"][1] - e["data_offsets"][0]
    floats = {d: n for d, n in sizes.items() if TORCH_DTYPES[d].is_floating_point}
    return TORCH_DTYPES[max(floats, key=floats.get)] if floats else torch.float32


def build_model(
    source: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    group: ProcessGroup | None = None, token: str | None = None, attn_implementation: str | None = None,
) -> torch.nn.Module:
    """This rank's TP model (tp = the group's world size), filled from its rank shard of `source`.

    The model is transformers' own class for config.json's `model_type` (`AutoModelForCausalLM`),
    built on the meta device, its layers swapped by the kinds the shard describes, materialized with
    `to_empty` and filled straight from the shard's bytes; `dtype` defaults to the stored one.
    """
    tp, rank = tp_world_size(group), tp_rank(group)
    config, chunks, sha, name = open_rank_stream(source, rank, tp, token=token)
    header, leftover = read_header_from(chunks, name)
    if (header.tp, header.rank) != (tp, rank):
        raise CheckpointError(f"{name}: is rank {header.rank} of tp={header.tp}, expected {rank} of {tp}")
    if dtype is None:
        Dequantizer(header.tensors, header.dtypes()).check_keep()
    model = meta_model(hf_config(config), dtype=dtype or stored_dtype(header),
                       attn_implementation=attn_implementation)
    tied = tied_pair(model)
    parallelize(model, header.tensors, group=group, tied=tied)
    model.to_empty(device=device)
    retie(model, tied)
    fill_parameters(header, chunks, shard_targets(model, header.model_tensors()), sha256=sha, leftover=leftover,
                    keep=dtype is None)
    init_buffers(model)
    install_gradient_sums(model)
    model.rank_header = header  # what `save_rank_shard` describes the saved file with
    model.hf_config = config
    return model


__all__ = ["RankHeader", "build_model", "open_rank_stream"]

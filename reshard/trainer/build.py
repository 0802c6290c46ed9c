"""`build_model`: the checkpoint's own transformers model on meta -> parallelize -> to_empty -> fill.

The source is a directory written by `reshard write` (or saved by the trainer), or the service's URL
for a checkpoint (`http://HOST:PORT/v1/checkpoints/NAME`): then only this rank's shard is pulled,
and its bytes go straight into the materialized parameters as they arrive.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed import ProcessGroup

from reshard.errors import CheckpointError
from reshard.fill.empty_model import hf_config, init_buffers
from reshard.fill.into_params import RankHeader, fill_parameters, read_header_from
from reshard.fill.open import open_rank_stream, open_relaid_stream
from reshard.format.torch_side import TORCH_DTYPES
from reshard.layout.mesh import Layout
from reshard.rules.quant.dequant import Dequantizer
from reshard.tp.comm import tp_rank, tp_world_size
from reshard.trainer.adjust import install_gradient_sums
from reshard.trainer.meta_model import meta_model, retie, tied_pair
from reshard.trainer.names import shard_targets
from reshard.trainer.parallel import parallelize


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
    sha256: str | None = None, relayout: bool = False,
) -> torch.nn.Module:
    """This rank's TP model (tp = the group's world size), filled from its rank shard of `source`.

    The model is transformers' own class for config.json's `model_type` (`AutoModelForCausalLM`),
    built on the meta device, its layers swapped by the kinds the shard describes, materialized with
    `to_empty` and filled straight from the shard's bytes; `dtype` defaults to the stored one.
    `sha256`: the rank file's recorded hash (a training checkpoint's), checked as it is read. With
    `relayout`, `source` is a directory of rank files of another tp, cut for this rank as it is read.
    """
    tp, rank = tp_world_size(group), tp_rank(group)
    if relayout:
        (config, chunks, name), sha = open_relaid_stream(source, rank, tp), None
    else:
        config, chunks, sha, name = open_rank_stream(source, rank, tp, token=token)
        sha = sha256 or sha
    header, leftover = read_header_from(chunks, name)
    if not header.layout.tp_only:
        raise CheckpointError(f"{name}: is a shard of {header.layout.describe()}; the bundled trainer runs tensor "
                              f"parallelism only: write rank files of tp={tp} alone (reshard write SHARDS --tp {tp} -o DIR)")
    header.check(rank, Layout(tp=tp), fix=f"give it rank {rank}'s shard of tp={tp}")
    quant = Dequantizer(header.tensors, header.dtypes())
    quant.check_trainable()
    if dtype is None:
        quant.check_keep()
    model = meta_model(hf_config(config), dtype=dtype or stored_dtype(header),
                       attn_implementation=attn_implementation)
    tied = tied_pair(model)
    parallelize(model, header.tensors, group=group, tied=tied)
    model.to_empty(device=device)
    retie(model, tied)
    fill_parameters(header, chunks, shard_targets(model, header.model_tensors()), sha256=sha, leftover=leftover,
                    keep=dtype is None, mapped=True)  # a local rank file's bytes mapped where the dtype is kept
    init_buffers(model)
    install_gradient_sums(model)
    model.rank_header = header  # what `save_rank_shard` describes the saved file with
    model.hf_config = config
    return model


__all__ = ["RankHeader", "build_model"]

"""`build_model`: the checkpoint's own transformers model on meta -> parallelize -> to_empty -> fill.

The source is a directory written by `reshard write` (or saved by the trainer), or the service's URL
for a checkpoint (`http://HOST:PORT/v1/checkpoints/NAME`): then only this rank's shard is pulled,
and its bytes go straight into the materialized parameters as they arrive.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from reshard.errors import CheckpointError
from reshard.fill.empty_model import hf_config, init_buffers
from reshard.fill.into_params import RankHeader, fill_parameters, read_header_from
from reshard.fill.open import open_cut_stream
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
    sha256: str | None = None, layout: Layout | None = None, rank: int | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """This rank's TP model (tp = the group's world size), filled from its rank shard of `source`.

    The model is transformers' own class for config.json's `model_type` (`AutoModelForCausalLM`),
    built on the meta device, its layers swapped by the kinds the shard describes, materialized with
    `to_empty` and filled straight from the shard's bytes; `dtype` defaults to the stored one.
    `sha256`: the rank file's recorded hash (a training checkpoint's), checked as it is read. A source
    that holds another layout (or an HF checkpoint) is cut for this rank as it is read.

    `layout` is the layout of the file this process fills from (default: tp over `group`), `rank` its rank
    in it (default: the tp rank). Beyond tp (fsdp x tp) the layers are swapped by the tp rank's own
    description, `shard` (`fully_shard`) runs on the meta model, and the materialized parameters' local
    parts are filled with this rank's file of `layout`: its dim-0 chunks, nothing more is read.
    """
    tp, tp_r = tp_world_size(group), tp_rank(group)
    layout, rank = layout or Layout(tp=tp), tp_r if rank is None else rank
    beyond = {k: v for k, v in layout.sizes().items() if v != 1 and k not in ("tp", "fsdp")}
    if layout.tp != tp or beyond or (layout.fsdp > 1) != (shard is not None):
        raise CheckpointError(f"{source}: the bundled trainer fills fsdp x tp layouts sharded by `shard` (tp over "
                              f"its group of {tp}), not {layout.describe()}")
    config, chunks, sha, name = open_cut_stream(source, rank, layout, token=token)
    header, leftover = read_header_from(chunks, name)
    header.check(rank, layout, fix=f"give it rank {rank}'s shard of {layout.describe()}")
    quant = Dequantizer(header.tensors, header.dtypes())
    quant.check_trainable()
    if dtype is None:
        quant.check_keep()
    dtype_used = dtype or stored_dtype(header)
    model = meta_model(hf_config(config), dtype=dtype_used, attn_implementation=attn_implementation)
    tied = tied_pair(model)
    parallelize(model, header.tensors if shard is None else _tp_header(source, tp_r, tp, token).tensors,
                group=group, tied=tied)
    if shard is not None:
        shard(model)
    model.to_empty(device=device)
    retie(model, tied)
    fill_parameters(header, chunks, shard_targets(model, header.model_tensors()), sha256=sha256 or sha,
                    leftover=leftover, keep=dtype is None, mapped=shard is None)  # a local rank file's bytes mapped where the dtype is kept
    init_buffers(model)
    install_gradient_sums(model)
    model.rank_header = header  # what `save_rank_shard` describes the saved file with
    model.hf_config = with_dtype(config, dtype_used)  # what a save writes beside its files: their dtype
    return model


def with_dtype(config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """`config` whose `dtype` (and `torch_dtype`, where present) names `dtype`: a checkpoint's config.json
    says what its tensors are stored in (a bfloat16 source trained in float32 is saved in float32)."""
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    return {**config, **dict.fromkeys(keys, name)}


def _tp_header(source: str | Path, rank: int, tp: int, token: str | None) -> RankHeader:
    """The header of tp rank `rank`'s file of `source` (what the layers are swapped by), read alone."""
    _, chunks, _, name = open_cut_stream(source, rank, tp, token=token, need_config=False)
    try:
        return read_header_from(chunks, name)[0]
    finally:
        if hasattr(chunks, "close"):
            chunks.close()


__all__ = ["RankHeader", "build_model", "with_dtype"]

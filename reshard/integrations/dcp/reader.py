"""`ReshardReader`: torch DCP reads any checkpoint reshard reads, each rank only the blocks it holds.

    import torch.distributed.checkpoint as dcp
    from reshard.integrations.dcp import ReshardReader

    dcp.load(model.state_dict(), storage_reader=ReshardReader("http://HOST:PORT/v1/checkpoints/NAME"))
    # or ReshardReader("ckpt/"), ReshardReader("s3://bucket/ckpt/"), a directory of rank files, ...

torch's load planner asks the destination state dict what it needs (any mix of DTensor placements:
FSDP2, TP, both, strided shards; plain tensors) and turns it into read items, each a block of a named
tensor (offsets, lengths). This reader answers them as boxes (`reshard.format.box_request`): one request
per rank to the service (`POST .../boxes`), or planned here from a path or store; the bytes land straight
in the destination where it is a contiguous tensor of the checkpoint's dtype (else they are cast into it).

`read_metadata` describes the checkpoint from its headers (the service's description: one GET), every
tensor as one chunk covering all of it, under its name on disk and, where the checkpoint's config.json
names a transformers architecture, also under the names transformers' model has (renamed keys, MoE
experts fused into one tensor, a tied head; `reshard.fill.stored_names`): the model is built on the meta
device from config.json, or is the `model` given. No pickle is read, nothing is executed.

`bytes_read` is what the last `read_data` received (the answer's size, its header included).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from reshard.errors import CheckpointError, PlanError
from reshard.fill.box_fill import read_boxes_into
from reshard.fill.held_boxes import Block, held_blocks, landing
from reshard.fill.stored_names import Stored, boxes_of, model_for, stored_names
from reshard.format.box_request import Box
from reshard.format.checkpoint import Source
from reshard.format.torch_side import TORCH_DTYPES
from reshard.io.client.box_client import is_service_url, tensor_listing

__all__ = ["ReshardReader"]


class ReshardReader(StorageReader):
    """A `torch.distributed.checkpoint.StorageReader` of `source` (the module docstring): the service's
    checkpoint URL, or a checkpoint or rank-file directory (local, `s3://`, `http(s)://`). `model`: the
    module whose names to offer besides the names on disk (default: transformers' model of config.json,
    built on the meta device; `names="disk"` offers the names on disk alone). `token`: the service's."""

    def __init__(self, source: str | os.PathLike[str], *, model: nn.Module | None = None, names: str = "model",
                 token: str | None = None, timeout: float = 60.0) -> None:
        super().__init__()
        if names not in ("model", "disk"):
            raise ValueError(f"names={names!r}: expected 'model' or 'disk'")
        self.source, self.model, self.names, self.token, self.timeout = source, model, names, token, timeout
        self.stored: dict[str, Stored] = {}
        self.bytes_read = 0
        self._opened: Source | None = None
        self.load_id = str(uuid.uuid4())

    # --- the protocol ----------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.source = checkpoint_id
        self.stored, self._opened, self.load_id = {}, None, str(uuid.uuid4())

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        return self.source

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A service URL, a URL of a store, or a local directory (its files are checked when read)."""
        return is_service_url(checkpoint_id) or "://" in str(checkpoint_id) or os.path.isdir(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        listing, config, self._opened = tensor_listing(self.source, token=self.token)
        model = None if self.names == "disk" else self.model if self.model is not None else model_for(config)
        try:
            self.stored = stored_names(listing, model=model)
        except PlanError:
            if self.model is not None:
                raise
            self.stored = stored_names(listing)  # transformers' own fusing cannot be read back: names on disk
        described = {name: _tensor_metadata(s.dtype, s.shape) for name, s in self.stored.items()}
        return Metadata(state_dict_metadata=described, storage_data={},  # type: ignore[arg-type]
                        storage_meta=StorageMeta(checkpoint_id=str(self.source), load_id=self.load_id))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self.stored:  # a reader given metadata read elsewhere: the names are those it describes
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every read item of `plan` as boxes, in one request; each destination committed once filled."""
        state = getattr(planner, "state_dict", None) or {}
        boxes: list[Box] = []
        outs: list[torch.Tensor] = []
        filled = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO or fqn not in self.stored:
                raise CheckpointError(f"{self.source}: has no tensor {fqn!r} to read (it holds tensors only, "
                                      f"{len(self.stored)} names)")
            dest = planner.resolve_tensor(item).detach()
            for offsets, sizes, at in _blocks(state.get(fqn), item):
                for box, land, land_sizes in boxes_of(self.stored[fqn], offsets, sizes):
                    boxes.append(box)
                    outs.append(landing(dest, tuple(map(int.__add__, at, land)), land_sizes, len(box.sizes)))
            filled.append((item, dest))
        self.bytes_read = read_boxes_into(self._opened if self._opened is not None else self.source, boxes, outs,
                                          token=self.token, timeout=self.timeout)
        for item, dest in filled:
            planner.commit_tensor(item, dest)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _blocks(dest: Any, item: ReadItem) -> list[Block]:
    """The global blocks an item's destination holds: the item's own box, except for a DTensor with strided
    shards, whose local tensor DCP describes as one contiguous chunk of the global tensor when it is
    several (transformers' packed gate|up: rows of gate, then the same rows of up); there what the local
    tensor holds is read (`reshard.fill.held_boxes`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(dest, DTensor) and any(isinstance(p, _StridedShard) for p in dest.placements):
        return held_blocks(dest, item.dest_offsets, item.lengths)
    return [(tuple(item.storage_offsets), tuple(item.lengths), (0,) * len(item.lengths))]


def _tensor_metadata(dtype: str, shape: tuple[int, ...]) -> TensorStorageMetadata:
    """One tensor stored as one chunk covering all of it."""
    return TensorStorageMetadata(properties=TensorProperties(dtype=TORCH_DTYPES[dtype]), size=torch.Size(shape),
                                 chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)),
                                                              sizes=torch.Size(shape))])

"""Where a rank's slice goes in a vLLM parameter: the place vLLM's own weight_loader would copy it to.

A parameter's `weight_loader` is a method of the layer that owns it (or vLLM's `default_weight_loader`);
the owner's class says how the parameter is laid out on this rank, with vLLM's own attributes:

| owner                                 | call                      | place in the parameter                         |
|---------------------------------------|---------------------------|------------------------------------------------|
| QKVParallelLinear                     | shard_id "q" / "k" / "v"  | that block of dim `output_dim`, vLLM's offsets |
| MergedColumnParallelLinear            | shard_id i (or a tuple)   | block i (its output size / tp)                 |
| RoutedExperts (FusedMoE)              | shard_id w1/w3/w2, expert | the local expert's gate / up half of w13, w2   |
| RoutedExperts, gpt-oss MXFP4          | None, None (all experts)  | the whole parameter, less vLLM's padding       |
| Column/Row/Replicated linears, VocabParallelEmbedding, ParallelLMHead, default_weight_loader | any | the whole parameter |

With a shard_id of None a fused tensor on disk (Phi-3's `qkv_proj`) fills the whole parameter: reshard's
packed kinds cut it per block, which is vLLM's layout. Any other loader is refused when it is called.

Quantized linears (GPTQ, AWQ, compressed-tensors int4) hold their tensors in vLLM's `BasevLLMParameter`s:
a block's offset and size along `output_dim` are in packed units where the parameter is packed along that
dim (`packed_dim == output_dim`: AWQ's qweight, every format's zero points), as vLLM's own
`adjust_shard_indexes_for_packing` divides them; a parameter with no `output_dim` (compressed-tensors'
`weight_shape`) is whole, and each block of a fused layer fills all of it, as vLLM's loader overwrites it.
NVFP4's per-tensor scalars (ModelOpt's `weight_scale_2`/`input_scale`, compressed-tensors' global scales:
vLLM's `PerTensorScaleParameter`) hold one value per fused block: block i's scalar goes to element i, as
vLLM's `_load_into_shard_id` puts it ("q", "k", "v" are 0, 1, 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from reshard.errors import PlanError

Dest = tuple[torch.Tensor | None, Any]


class Place:
    """The whole parameter (a plain, row or column linear, an embedding, a norm)."""

    moe = False

    def __init__(self, name: str, owner: Any) -> None:
        self.name, self.owner = name, owner

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any, expert_id: Any) -> Dest:
        data = param.data
        if data.numel() == 1 and loaded.numel() == 1:  # a scalar, as default_weight_loader takes it
            return data.reshape(loaded.shape), None
        return data, None


def _block(param: nn.Parameter, dim: int, start: int, size: int) -> torch.Tensor:
    """`param`'s block of `size` rows from `start` along `dim` (logical units), in the parameter's own units."""
    factor = getattr(param, "packed_factor", None)
    if factor is not None and getattr(param, "packed_dim", None) == dim:
        start, size = int(start // factor), int(size // factor)
    return param.data.narrow(dim, start, size)


def _per_tensor(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> Dest | None:
    """Block `shard_id`'s scalar of a fused layer's per-tensor scale (`PerTensorScaleParameter`); None for any
    other parameter."""
    from vllm.model_executor.parameter import PerTensorScaleParameter

    if not isinstance(param, PerTensorScaleParameter) or loaded.numel() != 1:
        return None
    ids = tuple(shard_id) if isinstance(shard_id, (tuple, list)) else (shard_id,)
    if len(ids) != 1:
        raise PlanError(f"one scalar for the fused blocks {ids!r} of a per-tensor scale: vLLM keeps one per block")
    index = param._shard_id_as_int(ids[0])  # noqa: SLF001  (vLLM's own mapping of a block to its element)
    return param.data[index].reshape(loaded.shape), ("scale", ids[0])


def _whole(param: nn.Parameter, shard_id: Any) -> Dest:
    """A parameter with no output dim (a quantized layer's `weight_shape`), which every block fills whole."""
    return param.data, ("whole", shard_id)


class QKVPlace(Place):
    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any, expert_id: Any) -> Dest:
        dim = getattr(param, "output_dim", None)
        if shard_id is None:
            return super().__call__(param, loaded, shard_id, expert_id)
        if dim is None:
            return _per_tensor(param, loaded, shard_id) or _whole(param, shard_id)
        start = self.owner._get_shard_offset_mapping(shard_id)
        size = self.owner._get_shard_size_mapping(shard_id)
        if start is None or size is None:
            raise PlanError(f"{self.name}: vLLM's QKVParallelLinear has no block {shard_id!r}")
        return _block(param, dim, start, size), shard_id


class MergedPlace(Place):
    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any, expert_id: Any) -> Dest:
        dim = getattr(param, "output_dim", None)
        if shard_id is None:
            return super().__call__(param, loaded, shard_id, expert_id)
        ids = tuple(shard_id) if isinstance(shard_id, (tuple, list)) else (shard_id,)
        if dim is None:
            return _per_tensor(param, loaded, ids) or _whole(param, ids)
        sizes = [s // self.owner.tp_size for s in self.owner.output_sizes]
        start, size = sum(sizes[: ids[0]]), sum(sizes[ids[0] : ids[-1] + 1])
        return _block(param, dim, start, size), ids


class ExpertsPlace(Place):
    """w13 = [gate | up] per local expert along the intermediate dim, w2 whole per expert (vLLM's FusedMoE)."""

    moe = True

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any, expert_id: Any) -> Dest:
        if shard_id is None and expert_id is None and self.owner.quant_config is not None \
                and self.owner.quant_config.get_name() == "gpt_oss_mxfp4":
            return self._mxfp4(param), ("whole", "mxfp4")
        if shard_id not in ("w1", "w2", "w3") or expert_id is None:
            raise PlanError(f"{self.name}: vLLM's fused experts were asked for shard {shard_id!r} of expert {expert_id!r}")
        if getattr(param, "is_transposed", False):
            raise PlanError(f"{self.name}: transposed (quantized) expert weights are not supported by load_format='reshard'")
        data = param.data
        if loaded.ndim == data.ndim:  # all experts at once (a fused checkpoint tensor)
            block, region = data, ("all", shard_id)
        else:
            local = self.owner._map_global_expert_id_to_local_expert_id(int(expert_id))
            if local == -1:
                return None, None
            block, region = data[local], (int(expert_id), shard_id)
        dim = 1 if loaded.ndim == data.ndim else 0  # the intermediate dim of w13 (gate|up stacked on it)
        if shard_id != "w2":
            if self.owner.moe_config.is_act_and_mul:
                half = block.shape[dim] // 2
                block = block.narrow(dim, 0 if shard_id == "w1" else half, half)
        return _unpadded(block, loaded), region

    def _mxfp4(self, param: nn.Parameter) -> torch.Tensor:
        """gpt-oss' MXFP4 experts, all at once (gpt_oss.py): the front of the parameter the unpadded sizes fill,
        as vLLM's loader copies `param[:, :rows(, :bytes)]`; vLLM's padding stays as it made it (zeros)."""
        cfg = self.owner.moe_config
        inter, hidden = cfg.intermediate_size_per_partition_unpadded, cfg.hidden_dim_unpadded
        rows, k = (2 * inter, hidden) if ".w13_" in self.name else (hidden, inter)
        data = param.data.narrow(1, 0, rows)
        if data.ndim == 3:  # blocks as K/2 bytes, scales one per 32-block of K
            data = data.narrow(2, 0, k // (32 if self.name.endswith("_scale") else 2))
        return data


def _unpadded(block: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """The part of a padded expert block the checkpoint fills (vLLM pads some kernels' expert sizes)."""
    for d in range(min(block.ndim, loaded.ndim)):
        if block.shape[d] > loaded.shape[d]:
            block = block.narrow(d, 0, loaded.shape[d])
    return block


class Refused(Place):
    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any, expert_id: Any) -> Dest:
        kind = type(self.owner).__name__ if self.owner is not None else "a loader function"
        raise PlanError(f"{self.name}: vLLM loads this parameter with {kind}, whose layout load_format='reshard' "
                        "does not know; use load_format='auto' for this model")


def _owner_classes() -> list[tuple[type, type[Place]]]:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    # most specific first: QKV and Merged are ColumnParallelLinear too
    return [(QKVParallelLinear, QKVPlace), (MergedColumnParallelLinear, MergedPlace), (RoutedExperts, ExpertsPlace),
            (ColumnParallelLinear, Place), (RowParallelLinear, Place), (ReplicatedLinear, Place),
            (VocabParallelEmbedding, Place)]


def place_for(name: str, param: nn.Parameter, loader: Callable[..., Any] | None) -> Place:
    """The `Place` that stands for `loader` (the parameter's weight_loader) of parameter `name`."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    if loader is None or loader is default_weight_loader:
        return Place(name, None)
    owner = getattr(loader, "__self__", None)
    if owner is not None and getattr(loader, "__func__", None) is not None \
            and loader.__func__.__name__ in ("weight_loader", "weight_loader_v2"):
        for cls, place in _owner_classes():
            if isinstance(owner, cls):
                return place(name, owner)
    return Refused(name, owner)

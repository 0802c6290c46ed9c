"""gpt-oss in vLLM: the tensors `GptOssModel.load_weights` narrows itself, put in place by the plugin.

vLLM's other models narrow a full checkpoint tensor in each parameter's `weight_loader` (which the plugin
replaces, fill.py). gpt-oss' `_load_weights_mxfp4` narrows before calling the loader: it views the
MXFP4 blocks as `[E, rows, K/2]` bytes, takes gate_up's rows `[2*r*I/tp, 2*(r+1)*I/tp)` (I/tp rounded up
to whole 32-blocks) and down's K columns of the same range (in bytes, and in 32-blocks for the scales),
zeroes `down_proj_bias` on ranks other than 0 (added once, after the reduction), and copies each head's
`sinks` without a loader. Given a rank's slice it would narrow again; so these tensors are taken out of
the stream handed to `model.load_weights` and loaded here, as vLLM does with its narrowing already
done: the same view, the same zeroed bias, the same `RoutedExperts.weight_loader` call (the plugin's
stand-in for it, places.py). Everything else goes to vLLM's `load_weights` as for any model.

With `enable_expert_parallel` vLLM gives each rank whole experts of the full intermediate size, which a
tensor-parallel rank file does not hold: refused (one error, before anything loads).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from reshard.errors import ReshardError

_EXPERTS = ("_blocks", "_scales", "_bias")


def _experts(model: nn.Module) -> list[nn.Module]:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def is_gpt_oss_mxfp4(model: nn.Module) -> bool:
    """vLLM's gpt-oss with its experts in MXFP4 (`GptOssMxfp4Config`)."""
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    if not isinstance(model, GptOssForCausalLM):
        return False
    quant = [getattr(e.quant_config, "get_name", lambda: None)() if e.quant_config else None for e in _experts(model)]
    return bool(quant) and all(q == "gpt_oss_mxfp4" for q in quant)


def take_over(model: nn.Module, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` for `model.load_weights`, less the tensors gpt-oss' loader would narrow again (loaded here, into
    the parameters whose weight_loader the plugin installed). Other models: `pairs` unchanged."""
    if not is_gpt_oss_mxfp4(model):
        yield from pairs
        return
    moe = _experts(model)[0].moe_config.moe_parallel_config
    if moe.use_ep:
        raise ReshardError("load_format='reshard' loads gpt-oss' MXFP4 experts cut by tensor parallelism (reshard "
                           "write --engine vllm); with enable_expert_parallel vLLM wants whole experts on each rank: "
                           "turn expert parallelism off, or use load_format='auto'")
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_moe_expert_param_name

    params = dict(model.named_parameters())
    mapper = type(model).hf_to_vllm_mapper
    for name, tensor in pairs:
        target = mapper.map_name(name) if name.endswith((*_EXPERTS, ".sinks")) else None
        if target is not None:  # the experts' parameters sit in `routed_experts`, as vLLM's loader finds them
            target = maybe_remap_moe_expert_param_name(target, params)
        if target is None or target not in params:
            yield name, tensor
        else:
            _load(params[target], target, tensor, moe.tp_rank)


def _load(param: nn.Parameter, target: str, loaded: torch.Tensor, tp_rank: int) -> None:
    """What `_load_weights_mxfp4` does with an already narrowed tensor (see the module docstring)."""
    if target.endswith(".sinks"):
        param.weight_loader(param, loaded)
        return
    if target.endswith(("w13_weight", "w2_weight")):  # [E, rows, K/32, 16] -> [E, rows, K/2] bytes
        loaded = loaded.reshape(*loaded.shape[:2], -1)
    if target.endswith("w2_bias") and tp_rank != 0:
        loaded = torch.zeros_like(loaded)  # vLLM adds down's bias on rank 0 only
    param.weight_loader(param, loaded, weight_name=target, shard_id=None, expert_id=None)

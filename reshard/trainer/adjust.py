"""Per-rank adjustments, so that transformers' unmodified forward runs on local shards.

After the kind -> layer swaps, attention modules still hold global head counts. The default adjustment
(every architecture) sets, on any module whose q/k projections (or fused q|k|v) were split:

    num_heads / num_attention_heads   -> local query heads      (local q rows / head_dim)
    num_key_value_heads / num_kv_heads -> local kv heads        (1 when kv heads < tp: replicated)
    num_key_value_groups               -> local q heads // local kv heads

Where an architecture needs more, one decorated function registered under transformers' module class
name (or `model_type`, then it gets the whole model) does it; most need none:

    @register_adjustment("Phi3Attention")
    def _phi3(module, ctx): ...      # return a module to replace it, or None

Lookup uses the class transformers built at that path (before any swap); `ctx.original` is that module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from reshard.errors import RegistryError
from reshard.registry import registrar
from reshard.tp import VocabParallelEmbedding, copy_to_tp_region, reduce_from_tp_region, tp_world_size

Spec = dict[str, Any]


@dataclass
class Context:
    """What an adjustment may look at: the module's path, the one transformers built there, all specs."""

    name: str
    original: nn.Module
    specs: dict[str, Spec]
    group: ProcessGroup | None
    model: nn.Module

    def spec(self, child: str) -> Spec | None:
        """The self-description of `<this module>.<child>.weight`, None if absent or replicated."""
        spec = self.specs.get(f"{self.name}.{child}.weight" if self.name else f"{child}.weight")
        return spec if spec is not None and spec["kind"] != "replicate" else None


Adjustment = Callable[[nn.Module, Context], "nn.Module | None"]
_ADJUSTMENTS: dict[str, Adjustment] = {}


def register_adjustment(*names: str) -> Callable[[Adjustment], Adjustment]:
    """Bind transformers module class names (or model_types) to an adjustment; twice is an error."""
    return registrar(_ADJUSTMENTS, names, lambda n: f"adjustment for {n!r}")


def known_adjustments() -> list[str]:
    return sorted(_ADJUSTMENTS)


def _rows(spec: Spec) -> list[int]:
    """Local rows of each block along dim 0 (one interval per block for packed kinds)."""
    return [b - a for a, b in spec["select"][0]]


def local_heads(module: nn.Module, ctx: Context) -> tuple[int, int] | None:
    """(local query heads, local kv heads) from the split q/k (or fused q|k|v) projection, else None."""
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    q, k = ctx.spec("q_proj"), ctx.spec("k_proj")
    if q is not None and k is not None:
        return sum(_rows(q)) // head_dim, sum(_rows(k)) // head_dim
    qkv = ctx.spec("qkv_proj")
    if qkv is not None and len((qkv.get("options") or {}).get("blocks", ())) == 3:
        rows = _rows(qkv)
        return rows[0] // head_dim, rows[1] // head_dim
    return None


_Q_ATTRS = ("num_heads", "num_attention_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads")


def _set_heads(module: nn.Module, ctx: Context, swapped: set[str]) -> None:
    heads = local_heads(module, ctx)
    if heads is None:
        return
    q, kv = heads
    for attrs, value in ((_Q_ATTRS, q), (_KV_ATTRS, kv), (("num_key_value_groups",), q // kv)):
        for attr in attrs:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, value)
    if type(ctx.original).__name__ not in _ADJUSTMENTS:
        _per_head_parameters(module, ctx, swapped)


def _per_head_parameters(module: nn.Module, ctx: Context, swapped: set[str]) -> None:
    """Replicated parameters applied to every local head (Qwen3's q_norm/k_norm over head_dim) get
    their gradient summed over the ranks, which hold different heads; anything else applied to split
    activations would be silently wrong, so it is an error naming the fix."""
    if tp_world_size(ctx.group) == 1:
        return
    for child_name, child in module.named_children():
        full = f"{ctx.name}.{child_name}" if ctx.name else child_name
        params = list(child.parameters())
        if full in swapped or not params or any(n.startswith(f"{full}.") for n in swapped):
            continue
        if all(p.dim() == 1 and p.numel() == module.head_dim for p in params):
            setattr(child, GRAD_SUM, ctx.group)
            continue
        raise RegistryError(
            f"{full}: {type(child).__name__} (parameter shapes {[list(p.shape) for p in params]}) acts on "
            f"split attention heads of {type(ctx.original).__name__}, which reshard cannot adjust by itself; "
            f"register one with @register_adjustment({type(ctx.original).__name__!r}) in reshard.trainer.adjust"
        )


GRAD_SUM = "_reshard_grad_sum_group"


def install_gradient_sums(model: nn.Module) -> None:
    """After materializing: hook the parameters marked above so their gradients are all-reduced."""
    for module in model.modules():
        if hasattr(module, GRAD_SUM):
            group = getattr(module, GRAD_SUM)
            for p in module.parameters(recurse=False):
                p.register_hook(lambda g, group=group: reduce_from_tp_region(g.clone(), group))


def _overrides_forward(module: nn.Module) -> bool:
    base = nn.Linear if isinstance(module, nn.Linear) else nn.Embedding if isinstance(module, nn.Embedding) else None
    return base is not None and type(module).forward is not base.forward


def adjust(model: nn.Module, originals: dict[str, nn.Module], specs: dict[str, Spec],
           group: ProcessGroup | None, swapped: set[str]) -> None:
    """Run the default and the registered adjustments on every module (`originals`: before the swaps)."""
    for name, original in originals.items():
        current = model.get_submodule(name) if name else model
        ctx = Context(name, original, specs, group, model)
        _set_heads(current, ctx, swapped)
        fn = _ADJUSTMENTS.get(type(original).__name__)
        if fn is None and name in swapped and _overrides_forward(original):
            raise RegistryError(
                f"{name}: {type(original).__name__} has its own forward, which the parallel layer would drop; "
                f"register one with @register_adjustment({type(original).__name__!r}) in reshard.trainer.adjust"
            )
        new = fn(current, ctx) if fn is not None else None
        if new is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    fn = _ADJUSTMENTS.get(getattr(model.config, "model_type", ""))
    if fn is not None:
        fn(model, Context("", model, specs, group, model))


# --- registered adjustments ---------------------------------------------------------------------------


@register_adjustment("Phi3Attention")
def _phi3_attention(module: nn.Module, ctx: Context) -> None:
    """Phi-3 splits its fused q|k|v at `config.num_attention_heads * head_dim`: give it a local config."""
    heads = local_heads(module, ctx)
    if heads is not None:
        module.config = copy.copy(module.config)
        module.config.num_attention_heads, module.config.num_key_value_heads = heads


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding times `embed_scale`, as Gemma's `*ScaledWordEmbedding` computes it."""

    def __init__(self, *args: Any, embed_scale: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scalar_embed_scale = embed_scale
        self.embed_scale = nn.Buffer(torch.tensor(embed_scale, device=self.weight.device), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the non-persistent scale after `to_empty`, exactly as transformers' __init__ does."""
        self.embed_scale = nn.Buffer(torch.tensor(self.scalar_embed_scale).to(self.weight.device), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


@register_adjustment("GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding",
                     "Gemma3TextScaledWordEmbedding")
def _scaled_embedding(module: nn.Module, ctx: Context) -> nn.Module | None:
    if not isinstance(module, VocabParallelEmbedding):
        return None  # replicated: transformers' own module stays
    return ScaledVocabParallelEmbedding(
        module.num_embeddings, module.embedding_dim, padded_num_embeddings=module.padded_num_embeddings,
        padding_idx=module.padding_idx, group=module.group, device="meta", dtype=module.weight.dtype,
        embed_scale=float(ctx.original.scalar_embed_scale))


class SplitWidthRMSNorm(nn.Module):
    """An RMSNorm over the full q (or k) width, applied to this rank's heads only (OLMo-2, OLMoE).

    The mean of squares is all-reduced over the ranks (forward and backward: every rank normalizes
    with it); ranks sharing a kv head each count it, so the sum is divided by tp x local width, which is
    the global width times the replication. The weight stays whole and replicated under its own name;
    each rank uses the columns of its heads (`cols`, from the projection's selection) and its gradient
    is summed over the ranks.
    """

    def __init__(self, norm: nn.Module, cols: list[tuple[int, int]], group: ProcessGroup | None, *,
                 cast_then_scale: bool) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.cols, self.group, self.cast_then_scale = cols, group, cast_then_scale
        self.tp = tp_world_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, h = x.dtype, x.to(torch.float32)
        squares = copy_to_tp_region(reduce_from_tp_region(h.pow(2).sum(-1, keepdim=True), self.group), self.group)
        h = h * torch.rsqrt(squares / (self.tp * h.shape[-1]) + self.variance_epsilon)
        w = copy_to_tp_region(self.weight, self.group)
        w = torch.cat([w[a:b] for a, b in self.cols]) if len(self.cols) > 1 else w[self.cols[0][0] : self.cols[0][1]]
        return w * h.to(dtype) if self.cast_then_scale else (w * h).to(dtype)


def _split_width_norms(module: nn.Module, ctx: Context, *, cast_then_scale: bool) -> None:
    if tp_world_size(ctx.group) == 1:
        return
    for norm, proj in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
        spec = ctx.spec(proj)
        if spec is not None:
            cols = [tuple(iv) for iv in spec["select"][0]]
            setattr(module, norm, SplitWidthRMSNorm(getattr(module, norm), cols, ctx.group,
                                                    cast_then_scale=cast_then_scale))


@register_adjustment("Olmo2Attention")
def _olmo2_attention(module: nn.Module, ctx: Context) -> None:
    """OLMo-2 normalizes q and k over all heads' width before splitting them into heads."""
    _split_width_norms(module, ctx, cast_then_scale=False)


@register_adjustment("OlmoeAttention")
def _olmoe_attention(module: nn.Module, ctx: Context) -> None:
    """OLMoE: as OLMo-2, its RMSNorm casting before the weight."""
    _split_width_norms(module, ctx, cast_then_scale=True)


__all__ = ["Context", "ScaledVocabParallelEmbedding", "SplitWidthRMSNorm", "adjust", "install_gradient_sums", "known_adjustments",
           "local_heads", "register_adjustment"]

"""Dequantize on fill: a rank shard's FP8 weights into the training dtype, one tensor at a time.

`Dequantizer(header)` reads the shard's self-description: every `X.weight` of a quantized kind whose
scale (`X.weight_scale_inv` / `X.weight_scale`) is in the shard. The fill hands it each tensor as it
arrives (`feed`); a scale is kept (scales are ~1/B0*B1 of their weight), a weight waits for its scale
if it comes first, and what comes out is `weight * scale` per block, in float32, for the caller to
copy into the parameter. At most one weight's full-precision copy exists at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from reshard.errors import PlanError
from reshard.rules.quant.fp8_kinds import base_kind, granularity
from reshard.rules.quant.scheme import Block, QuantScheme, scheme_of_kind, schemes


def _torch_dtypes(scheme: QuantScheme) -> frozenset[torch.dtype]:
    return frozenset(getattr(torch, n) for n in scheme.torch_dtypes)


PACKED = frozenset().union(*map(_torch_dtypes, schemes()))  # every scheme's stored dtypes (FP8: e4m3fn, e5m2)


def _index(weight_select: list[list[int]], scale_select: list[list[int]], block: int | None) -> torch.Tensor:
    """For each local index of the weight along one dim, the local index of its scale."""
    rows = torch.cat([torch.arange(a, b) for a, b in weight_select]) if weight_select else torch.zeros(0, dtype=torch.long)
    if block is None:
        return torch.zeros(len(rows), dtype=torch.long)
    end = max(b for _, b in scale_select)
    lut = torch.full((end,), -1, dtype=torch.long)
    pos = 0
    for a, b in scale_select:
        lut[a:b] = torch.arange(pos, pos + b - a)
        pos += b - a
    blocks = rows // block
    idx = lut[blocks.clamp(max=end - 1)]
    if (blocks >= end).any() or (idx < 0).any():
        raise PlanError("the shard's scale does not hold the blocks of its weight's rows")
    return idx


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Block, *,
               weight_select: list[list[list[int]]] | None = None,
               scale_select: list[list[list[int]]] | None = None) -> torch.Tensor:
    """`weight * scale` in float32, each scale entry covering a block of `block` (null: the whole dim).

    With the selections a rank shard records (global index intervals per dim), a rank's piece is
    dequantized with the scale blocks of exactly the rows and columns it holds; without them both
    are whole tensors.
    """
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if s.dim() != w.dim():
        raise PlanError(f"scale of shape {list(s.shape)} does not fit weight of shape {list(w.shape)}")
    wsel = weight_select or [[[0, n]] for n in w.shape]
    ssel = scale_select or [[[0, n]] for n in s.shape]
    for d, b in enumerate(granularity(w.dim(), block)):
        s = s.index_select(d, _index(wsel[d], ssel[d], b))
    return w * s


class Dequantizer:
    """Pairs the quantized weights of one rank shard with their scales as the fill streams them."""

    def __init__(self, tensors: dict[str, dict[str, Any]], dtypes: dict[str, torch.dtype]) -> None:
        self.tensors = tensors
        self.weights: dict[str, str] = {}  # quantized weight -> its scale
        self.companions: set[str] = set()
        for name, desc in tensors.items():
            stem = name[: -len(".weight")]
            scheme, scale = next(((q, stem + s) for q in schemes() for s in q.scale_suffixes if stem + s in tensors),
                                 (None, None))
            if not name.endswith(".weight") or scheme is None or dtypes.get(name) not in _torch_dtypes(scheme):
                continue
            if scheme.base_of(desc.get("kind", "")) is None:
                raise PlanError(
                    f"{name}: {scheme.name.upper()} with {scale} beside it, but its kind {desc.get('kind')!r} records "
                    "no scale block; write the shards from a checkpoint whose config.json has its quantization_config, "
                    f"or with a rules file using kind {desc.get('kind')}{scheme.suffix} and `block`"
                )
            self.weights[name] = scale
            self.companions.update(stem + s for s in scheme.companions if stem + s in tensors)
        self._scale_of = {s: w for w, s in self.weights.items()}  # scale -> its weight
        self._held: dict[str, torch.Tensor] = {}
        self.dtypes = dtypes
        # tensors of a format described by parts (MXFP4, NVFP4, int4): filled as stored, never dequantized here
        self.packed = {name: q for name, desc in tensors.items()
                       for q in [scheme_of_kind(desc.get("kind", ""))] if q is not None and q.parts}

    def check_packed(self, name: str, target: torch.Tensor | None = None) -> None:
        """A tensor of a packed 4-bit format goes into a parameter that holds it as stored (a consumer such as
        vLLM's packed parameters); into a parameter of another dtype (a dequantized layer) it is an error:
        the fill has no dequantizer for these formats. With no target: any such tensor is an error."""
        scheme = self.packed.get(name)
        if scheme is None or (target is not None and target.dtype == self.dtypes.get(name)):
            return
        into = "" if target is None else f" into a {str(target.dtype).removeprefix('torch.')} parameter"
        raise PlanError(
            f"{name}: {scheme.description}; the fill copies these tensors as stored and cannot dequantize them"
            f"{into}: fill a model whose parameters hold the packed tensors (vLLM's, load_format='reshard'), or "
            "train from a dequantized checkpoint"
        )

    def check_trainable(self) -> None:
        """The bundled trainer's layers compute in bf16/fp32: a shard of a packed 4-bit format is an error."""
        for name in sorted(self.packed, key=lambda n: not n.endswith(self.packed[n].weight_suffix)):  # a weight first
            self.check_packed(name)

    def check_target(self, name: str, target: torch.Tensor, *, keep: bool = False) -> None:
        """A quantized weight is dequantized into a bf16/fp32 parameter; keeping it FP8 is an error. A packed
        4-bit tensor is copied as stored (`check_packed`)."""
        self.check_packed(name, target)
        if name in self.weights and (keep or target.dtype in PACKED or not target.dtype.is_floating_point):
            raise PlanError(
                f"{name}: --dtype keep: the shard holds it in FP8 with a block scale, and the trainer's layers "
                "have no FP8 matmul (F.linear does not take float8 weights) to train it as stored; pass "
                "--dtype bfloat16 or float32 (build_model(dtype=...)) to dequantize it on fill"
            )

    def check_keep(self) -> None:
        """`--dtype keep` (build in the stored dtype) on a shard with FP8 weights: check_target's error,
        before a model is built in a dtype torch cannot make default."""
        for name in self.weights:
            self.check_target(name, torch.empty(0, device="meta"), keep=True)

    def feed(self, name: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """What the tensor `name` (as read) puts into which parameter: itself, or a dequantized weight
        once both it and its scale are here; nothing for a companion."""
        if name not in self.weights and name not in self.companions:
            yield name, value
            return
        weight = name if name in self.weights else self._scale_of.get(name)
        if weight is None:  # an input_scale: the dequantized layer computes without it
            return
        self._held[name] = value
        if weight not in self._held or self.weights[weight] not in self._held:
            return
        scale_name = self.weights[weight]
        w, s = self._held.pop(weight), self._held.pop(scale_name)
        wd, sd = self.tensors[weight], self.tensors[scale_name]
        yield weight, dequantize(w, s, tuple((wd.get("options") or {})["block"]),
                                 weight_select=wd["select"], scale_select=sd["select"])

    def dequantized(self) -> dict[str, dict[str, Any]]:
        """The shard's self-description once its weights are dequantized: no companions, base kinds, no block."""
        out = {}
        for name, desc in self.tensors.items():
            if name in self.companions:
                continue
            if name in self.weights or scheme_of_kind(desc.get("kind", "")) is not None:
                options = {k: v for k, v in (desc.get("options") or {}).items() if k != "block"}
                desc = {**desc, "kind": base_kind(desc["kind"])}
                desc.pop("options", None)
                if options:
                    desc["options"] = options
            out[name] = desc
        return out

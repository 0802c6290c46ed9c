"""compressed-tensors `pack-quantized` (llm-compressor's W4A16: `quant_method: compressed-tensors`,
`format: pack-quantized`), 4-bit integers, symmetric or with zero points, groups or channels.

A quantized module `X` (a linear `W [N, K]`) stores:

| tensor | dtype, shape | packed / grouped along |
|---|---|---|
| `X.weight_packed` | I32 `[N, K/8]` | 8 values per int32 along K |
| `X.weight_scale` | `[N, K/g]` (`[N, 1]` channelwise) | groups along K |
| `X.weight_zero_point` | I32 `[N/8, K/g]` (asymmetric only) | 8 zero points per int32 along N, groups along K |
| `X.weight_g_idx` | I32 `[K]` (`actorder: group`) | the group of each input |
| `X.weight_shape` | I64 `[2]` | `[N, K]` of the whole weight: every rank gets it, as vLLM loads it |

A column split cuts N (N per rank a multiple of 8 when zero points are stored: the rule option
`zero_points` is 8 for asymmetric checkpoints, null for symmetric ones, which store none), a row split
cuts K (a multiple of 8 and of g). Channelwise scales and `actorder: group` keep every group on every rank
(`reshard.rules.quant.int4`). Modules in `ignore` are stored unquantized and keep the plain kinds.
All config groups must agree on the group size and act order (else: a rules file per pattern).
"""

from __future__ import annotations

from typing import Any

from reshard.errors import ManifestError
from reshard.rules.quant.int4 import BASES, group_options, unit_names
from reshard.rules.quant.parts import register_part_kinds
from reshard.rules.quant.scheme import (
    Axis,
    Part,
    QuantScheme,
    Scheme,
    register_ct_format,
)

PACKED, ZEROS, GROUP = unit_names("compressed-tensors")

PACK_QUANTIZED = register_part_kinds(QuantScheme(
    "pack-quantized", "_ct_int4", bases=BASES, scale_suffixes=(".weight_scale",), replicated_suffixes=(),
    torch_dtypes=("int32",), weight_suffix=".weight_packed", logical_suffix=".weight",
    parts=(Part(".weight_packed", (Axis(-2), Axis(-1, 8, PACKED))),
           Part(".weight_scale", (Axis(-2), Axis(-1, "group_size", GROUP))),
           Part(".weight_zero_point", (Axis(-2, "zero_points", ZEROS), Axis(-1, "group_size", GROUP))),
           Part(".weight_g_idx", (Axis(-1),)),
           Part(".weight_shape", None)),
    description="compressed-tensors pack-quantized: int4 packed 8 per int32 along K (weight_packed [N, K/8]), "
                "weight_scale [N, K/g], weight_zero_point [N/8, K/g]"))

_ACT_ORDER = ("group", "dynamic", True)  # g_idx stored; "weight"/"static" reorder at quantization time only


@register_ct_format("pack-quantized")
def _pack_quantized(qc: dict[str, Any]) -> Scheme:
    """Every config group: 4-bit int weights, strategy `group` or `channel`, activations unquantized or
    dynamic (no tensors)."""
    where = "config.json quantization_config (compressed-tensors pack-quantized)"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ManifestError(f"{where}: no config_groups")
    found: list[Any] = []
    for gname, group in groups.items():
        group = group or {}
        w = group.get("weights") or {}
        at = f"{where}: group {gname!r}"
        if group.get("format") not in (None, "pack-quantized"):
            raise ManifestError(f"{at}: format {group['format']!r}; one format per checkpoint is supported")
        if w.get("type") != "int":
            raise ManifestError(f"{at}: {w.get('type')} weights; pack-quantized holds integers")
        if w.get("strategy") not in ("group", "channel"):
            raise ManifestError(f"{at}: weight strategy {w.get('strategy')!r}; supported: group, channel")
        inputs = group.get("input_activations")
        if inputs and not inputs.get("dynamic"):
            raise ManifestError(f"{at}: static input activation scales are not supported (dynamic or none are)")
        size = w.get("group_size") if w["strategy"] == "group" else -1
        params = group_options(at, bits=w.get("num_bits"), group=size, act_order=w.get("actorder") in _ACT_ORDER)
        params += (("zero_points", None if w.get("symmetric", True) else 8),)
        if found and params != found[0]:
            raise ManifestError(f"{where}: config groups differ in group size or act order ({dict(found[0])} and "
                                f"{dict(params)}); write a rules file with kinds *_ct_int4 and `group_size` per pattern")
        found.append(params)
    return Scheme("compressed-tensors", None, PACK_QUANTIZED, found[0])

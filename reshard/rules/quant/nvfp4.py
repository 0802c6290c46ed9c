"""NVFP4: FP4 E2M1 weights two per byte along K, an FP8 E4M3 scale per group of 16, a global FP32 scale.

Two exports of the same numbers (logical weight `[N, K]`, or `[E, N, K]` for fused experts):

| ModelOpt (`quant_method: modelopt`, `quant_algo: NVFP4`) | compressed-tensors (`format: nvfp4-pack-quantized`) | split |
|---|---|---|
| `X.weight` uint8 `[N, K/2]` | `X.weight_packed` uint8 `[N, K/2]` | with the weight, K in bytes of 2 values |
| `X.weight_scale` F8_E4M3 `[N, K/16]` | `X.weight_scale` F8_E4M3 `[N, K/16]` | with the weight, K in groups of 16 |
| `X.weight_scale_2` F32 scalar (w = q * s * s2) | `X.weight_global_scale` F32 `[1]` (w = q * s / g) | every rank |
| `X.input_scale` F32 scalar | `X.input_global_scale` F32 `[1]` | every rank |

A column split cuts N anywhere (heads, packed q|k|v, gate|up as the base kind says); a row split cuts
K on group edges (K per rank a multiple of 16). vLLM fuses q|k|v and gate|up and keeps one global scale
per fused sub-matrix (`PerTensorScaleParameter`): each module's scalar, which every rank holds whole.
"""

from __future__ import annotations

from typing import Any

from reshard.errors import ManifestError
from reshard.rules.quant.parts import register_part_kinds
from reshard.rules.quant.scheme import (
    Axis,
    Part,
    QuantScheme,
    Scheme,
    register_ct_format,
    register_quant_method,
)

GROUP = 16  # NVFP4's group size: values per FP8 scale
BASES = ("column", "row", "packed_column", "vocab_embed", "expert_column", "expert_row", "replicate")
BYTE = Axis(-1, 2, "byte of 2 FP4 values")
GROUP_AXIS = Axis(-1, "group_size", "NVFP4 group")


def _scheme(name: str, weight: str, scalars: tuple[str, str], description: str) -> QuantScheme:
    """One export of NVFP4: its weight's suffix and its two F32 scalars' (weight's global scale, input's)."""
    return register_part_kinds(QuantScheme(
        name, "_" + name.replace("-", "_"), bases=BASES, scale_suffixes=(".weight_scale",), replicated_suffixes=(),
        torch_dtypes=("uint8",), weight_suffix=weight, logical_suffix=".weight",
        parts=(Part(weight, (Axis(-2), BYTE)), Part(".weight_scale", (Axis(-2), GROUP_AXIS)),
               *(Part(s, None) for s in scalars)),
        description=description))


NVFP4 = _scheme("nvfp4", ".weight", (".weight_scale_2", ".input_scale"),
                "NVFP4 (ModelOpt): FP4 E2M1 two per byte along K, an F8_E4M3 scale per group of 16, "
                "F32 weight_scale_2 and input_scale")
NVFP4_CT = _scheme("nvfp4-ct", ".weight_packed", (".weight_global_scale", ".input_global_scale"),
                   "NVFP4 (compressed-tensors nvfp4-pack-quantized): FP4 E2M1 two per byte along K, an F8_E4M3 "
                   "scale per group of 16, F32 weight_global_scale and input_global_scale (divisors)")


def _group(value: Any, where: str) -> int:
    if value is None:
        return GROUP
    if type(value) is not int or value <= 0 or value % 2:
        raise ManifestError(f"{where}: group_size {value!r} must be a positive even integer (NVFP4 uses 16)")
    return value


@register_quant_method("modelopt")
def _modelopt(qc: dict[str, Any]) -> Scheme:
    """`{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}`, or the algorithm nested
    under `quantization` (hf_quant_config.json's form). Other ModelOpt algorithms are refused."""
    nested = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
    algo = str(qc.get("quant_algo") or nested.get("quant_algo") or "").upper()
    where = "config.json quantization_config (modelopt)"
    if algo != "NVFP4":
        raise ManifestError(f"{where}: quant_algo {algo or None!r} is not supported (supported: NVFP4); its "
                            "tensors would be split wrongly. See docs/quantization.md")
    group = _group(qc.get("group_size", nested.get("group_size")), where)
    return Scheme("modelopt", None, NVFP4, (("group_size", group),))


@register_ct_format("nvfp4-pack-quantized")
def _ct_nvfp4(qc: dict[str, Any]) -> Scheme:
    """compressed-tensors NVFP4: every config group 4-bit float weights, strategy `tensor_group`, one group size."""
    where = "config.json quantization_config (compressed-tensors nvfp4-pack-quantized)"
    sizes = set()
    for gname, group in (qc.get("config_groups") or {}).items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 4 or w.get("strategy") != "tensor_group":
            raise ManifestError(f"{where}: group {gname!r} has {w.get('num_bits')}-bit {w.get('type')} weights, "
                                f"strategy {w.get('strategy')!r}; NVFP4 is 4-bit float, strategy tensor_group")
        sizes.add(_group(w.get("group_size"), f"{where}: group {gname!r}"))
    if len(sizes) != 1:
        raise ManifestError(f"{where}: config groups use group sizes {sorted(sizes)}; write a rules file")
    return Scheme("compressed-tensors", None, NVFP4_CT, (("group_size", sizes.pop()),))

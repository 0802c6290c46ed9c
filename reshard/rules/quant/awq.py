"""AWQ (`quant_method: awq`, AutoAWQ's GEMM layout), 4-bit with zero points.

A quantized module `X` (a linear `W [N, K]`) stores:

| tensor | dtype, shape | packed / grouped along |
|---|---|---|
| `X.qweight` | I32 `[K, N/8]` | 8 values per int32 along N, in the order 0,2,4,6,1,3,5,7 |
| `X.qzeros` | I32 `[K/g, N/8]` | groups along K, 8 zero points per int32 along N (same order) |
| `X.scales` | F16 `[K/g, N]` | groups along K |

The nibble order is inside one int32, so a cut between int32s (N per rank a multiple of 8) keeps every
value's place; a row split cuts K on group edges. Modules in `modules_to_not_convert` are stored
unquantized and keep the plain kinds. The GEMV layout (`version: gemv`, qweight `[N, K/8]`) is refused.
"""

from __future__ import annotations

from typing import Any

from reshard.errors import ManifestError
from reshard.rules.quant.int4 import BASES, group_options, unit_names
from reshard.rules.quant.parts import register_part_kinds
from reshard.rules.quant.scheme import Axis, Part, QuantScheme, Scheme, register_quant_method

PACKED, ZEROS, GROUP = unit_names("AWQ")

AWQ = register_part_kinds(QuantScheme(
    "awq", "_awq", bases=BASES, scale_suffixes=(".scales",), replicated_suffixes=(), torch_dtypes=("int32",),
    weight_suffix=".qweight", logical_suffix=".weight",
    parts=(Part(".qweight", (Axis(-1), Axis(-2, 8, PACKED))),
           Part(".qzeros", (Axis(-1, "group_size", GROUP), Axis(-2, 8, ZEROS))),
           Part(".scales", (Axis(-1, "group_size", GROUP), Axis(-2)))),
    description="AWQ: int4 packed 8 per int32 along N (qweight [K, N/8]), scales [K/g, N], zeros [K/g, N/8]"))

_LAYOUTS = ("gemm", "exllama", "ipex")  # checkpoints of one layout; the name is the kernel that runs it


@register_quant_method("awq")
def _awq(qc: dict[str, Any]) -> Scheme:
    """`bits` (or `w_bit`) 4, `group_size` (or `q_group_size`), `version` gemm."""
    where = "config.json quantization_config (awq)"
    version = str(qc.get("version") or "gemm").lower()
    if version not in _LAYOUTS:
        raise ManifestError(f"{where}: version {version!r} stores qweight in another layout; supported: "
                            f"{', '.join(_LAYOUTS)} (qweight [K, N/8])")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    return Scheme("awq", None, AWQ, group_options(where, bits=bits, group=group, act_order=False))

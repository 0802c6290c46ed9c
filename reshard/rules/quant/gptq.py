"""GPTQ (`quant_method: gptq`, AutoGPTQ / GPTQModel / optimum checkpoints), 4-bit.

A quantized module `X` (a linear `W [N, K]`) stores:

| tensor | dtype, shape | packed / grouped along |
|---|---|---|
| `X.qweight` | I32 `[K/8, N]` | 8 values per int32 along K |
| `X.qzeros` | I32 `[K/g, N/8]` | groups along K, 8 zero points per int32 along N |
| `X.scales` | F16 `[K/g, N]` | groups along K |
| `X.g_idx` | I32 `[K]` | the group of each input (`k // g`, or any group under `desc_act`) |
| `X.bias` | F16 `[N]` | (not a part: split as the base kind splits a bias) |

So a column split cuts N (dim 1 of all three, N per rank a multiple of 8 for `qzeros`) and a row split
cuts K (dim 0: K per rank a multiple of 8 and of g; `g_idx` with it). With `desc_act` and for
channelwise scales (`group_size: -1`) every rank keeps all of `scales` and `qzeros` along K
(`reshard.rules.quant.int4`). GPTQModel's `dynamic` rules that change bits, groups or act order per
module are refused (a rules file can say it per pattern); its negative rules leave modules unquantized,
which their plain tensors show.
"""

from __future__ import annotations

from typing import Any

from reshard.errors import ManifestError
from reshard.rules.quant.int4 import BASES, group_options, unit_names
from reshard.rules.quant.parts import register_part_kinds
from reshard.rules.quant.scheme import Axis, Part, QuantScheme, Scheme, register_quant_method

PACKED, ZEROS, GROUP = unit_names("GPTQ")

GPTQ = register_part_kinds(QuantScheme(
    "gptq", "_gptq", bases=BASES, scale_suffixes=(".scales",), replicated_suffixes=(), torch_dtypes=("int32",),
    weight_suffix=".qweight", logical_suffix=".weight",
    parts=(Part(".qweight", (Axis(-1, 8, PACKED), Axis(-2))),
           Part(".qzeros", (Axis(-1, "group_size", GROUP), Axis(-2, 8, ZEROS))),
           Part(".scales", (Axis(-1, "group_size", GROUP), Axis(-2))),
           Part(".g_idx", (Axis(-1),))),
    description="GPTQ: int4 packed 8 per int32 along K (qweight [K/8, N]), scales [K/g, N], zeros [K/g, N/8]"))

_PER_MODULE = ("bits", "group_size", "desc_act")


@register_quant_method("gptq")
def _gptq(qc: dict[str, Any]) -> Scheme:
    """`bits` 4, `group_size` (-1: channelwise), `desc_act` (act order)."""
    where = "config.json quantization_config (gptq)"
    for pattern, overrides in (qc.get("dynamic") or {}).items():
        changed = sorted(k for k in _PER_MODULE if isinstance(overrides, dict) and k in overrides
                         and overrides[k] != qc.get(k))
        if not str(pattern).startswith("-:") and changed:
            raise ManifestError(f"{where}: dynamic rule {pattern!r} changes {', '.join(changed)} for some modules; "
                                "one setting per checkpoint is supported: write a rules file with kinds *_gptq and "
                                "`group_size` per pattern")
    return Scheme("gptq", None, GPTQ, group_options(where, bits=qc.get("bits"), group=qc.get("group_size"),
                                                    act_order=bool(qc.get("desc_act"))))

"""MXFP4 (OCP microscaling FP4, gpt-oss' `quant_method: mxfp4`): fused MoE experts in blocks of 32 FP4 values.

A quantized experts parameter `X` (`model.layers.N.mlp.experts.gate_up_proj`, `...down_proj`) is stored
as (logical weight `[E, N, K]`: N the output rows, K the input dim):

- `X_blocks` uint8 `[E, N, K/32, 16]`: per row, K/32 blocks of 32 FP4 E2M1 values, two per byte (the
  low nibble first);
- `X_scales` uint8 `[E, N, K/32]`: one E8M0 exponent per block (value = 2^(scale - 127));
- `X_bias` bf16 `[E, N]`, not quantized: it goes with the rows.

gate_up's rows interleave gate and up (row 2i is gate i, 2i+1 up i), so a contiguous split of its rows
keeps each pair on one rank as long as the boundaries are even; down's K is gate_up's intermediate dim,
split in whole blocks of 32. vLLM (`GptOssModel._load_weights_mxfp4`) gives tp rank r the intermediate
slice [r*I/tp, (r+1)*I/tp) of both (rows 2x that of gate_up), the bias of gate_up with its rows, down's
bias whole (added on rank 0 only: the rows' outputs are summed), or with expert parallelism whole
experts. transformers' gpt_oss plan splits experts by expert parallelism only (its TP plan replicates
them); `--engine vllm` (`ENGINE_RULES`) or a rules file with `expert_column` on gate_up and `expert_row`
on down splits them by TP. Rules written for the unquantized gpt-oss name the logical parameter
(`experts.gate_up_proj`), which the twins of this format match.
"""

from __future__ import annotations

from typing import Any

from reshard.rules.manifest import Rule
from reshard.rules.quant.parts import register_part_kinds
from reshard.rules.quant.scheme import Axis, Part, QuantScheme, Scheme, register_quant_method

BLOCK = 32  # FP4 values per scale (OCP MX block size)
BLOCK_AXIS = Axis(-1, BLOCK, "MXFP4 block of 32 FP4 values")

MXFP4 = register_part_kinds(QuantScheme(
    "mxfp4", "_mxfp4", bases=("expert_column", "expert_row", "column", "row", "replicate"),
    scale_suffixes=("_scales",), replicated_suffixes=(), torch_dtypes=("uint8",),
    weight_suffix="_blocks", logical_suffix="",
    parts=(Part("_blocks", (Axis(-2), BLOCK_AXIS, Axis(None))),  # [.., N, K/32, 16 bytes]
           Part("_scales", (Axis(-2), BLOCK_AXIS)),  # [.., N, K/32] E8M0
           Part("_bias", (Axis(-2),))),  # [.., N]
    description="MXFP4: FP4 E2M1 values two per byte in blocks of 32 along K, one E8M0 scale per block",
))


@register_quant_method("mxfp4")
def _mxfp4(qc: dict[str, Any]) -> Scheme:
    """gpt-oss: `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`; the unit is fixed (32)."""
    return Scheme("mxfp4", None, MXFP4)


# vLLM's cut of gpt-oss' experts under TP (no expert parallelism): gate_up's rows (gate/up pairs of the
# intermediate dim, whole blocks of 32: 64 rows) and down's K
ENGINE_RULES = (
    Rule(r".*\.mlp\.experts\.gate_up_proj_(blocks|scales|bias)", "expert_column_mxfp4", {"unit": [2 * BLOCK, None]},
         regex=True),
    Rule(r".*\.mlp\.experts\.down_proj_(blocks|scales|bias)", "expert_row_mxfp4", {}, regex=True),
)

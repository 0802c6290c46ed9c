"""What the int4 weight-only formats share (GPTQ, AWQ, compressed-tensors pack-quantized W4A16).

Each stores a linear weight `W [N, K]` (out, in) as 4-bit integers packed eight to an int32, a scale per
group of `g` inputs and output, and zero points packed eight to an int32 along N; the formats differ in
which dim the weight is packed along and in the order of the stored dims (`reshard.rules.quant.gptq`,
`.awq`, `.pack_quantized` describe each as `Part`s). A rank therefore takes K in multiples of 8 (whole
int32s) and of g (whole groups), and N in multiples of 8 where zero points are packed along it.

Two cases keep every group on every rank, as vLLM's loaders do (`marlin_repeat_scales_on_all_ranks`):
channelwise scales (one group of all K: `[1, N]` / `[N, 1]`), and act order (GPTQ `desc_act`,
compressed-tensors `actorder: group`), where `g_idx` sends each input to any group, so a rank holding
some inputs may need any scale. There the rule option `group_size` is null (scales and zeros whole
along K) and, under act order, the option `unit: [null, g]` keeps the rank boundaries on group edges
all the same, as the engines require of K per rank.
"""

from __future__ import annotations

from typing import Any

from reshard.errors import ManifestError

# the base kinds each int4 format has a twin of: `column` -> `column_gptq`, ...
BASES = ("column", "row", "packed_column", "vocab_embed", "replicate", "expert_column", "expert_row")
Params = tuple[tuple[str, Any], ...]


def unit_names(fmt: str) -> tuple[str, str, str]:
    """How an error names one stored index (`Axis.what`) of a format's packed weight, of its packed zero
    points and of its scales' groups: "inside one GPTQ group (32 values)"."""
    return f"{fmt} int32 of packed 4-bit values", f"{fmt} int32 of packed zero points", f"{fmt} group"


def group_options(where: str, *, bits: Any, group: Any, act_order: bool) -> Params:
    """The rule options of a checkpoint's int4 kinds (`Scheme.params`): `group_size` (null where every rank
    keeps all groups) and, under act order, `unit` (see the module docstring). `group` -1 is channelwise."""
    if bits != 4:
        raise ManifestError(f"{where}: {bits}-bit weights; only 4-bit integers (8 per int32) are supported")
    if group == -1:
        return (("group_size", None),)
    if type(group) is not int or group <= 0:
        raise ManifestError(f"{where}: group_size {group!r} must be a positive integer or -1 (channelwise)")
    if act_order:
        return (("group_size", None), ("unit", [None, group]))
    return (("group_size", group),)

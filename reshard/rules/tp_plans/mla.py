"""Optional: shard DeepSeek-style MLA attention by heads, beyond transformers' plan (`RESHARD_MLA=heads`).

transformers' DeepSeek-V3 plan replicates all of MLA. With `RESHARD_MLA=heads`, for a config with
`kv_lora_rank` (MLA), the per-head projections are split on head boundaries: `q_b_proj` (or `q_proj`
without a q LoRA) and `kv_b_proj` as `column` with `heads=num_attention_heads` (their outputs are
`heads x (qk_nope + qk_rope)` and `heads x (qk_nope + v)`, head-major), `o_proj` as `row` (its input is
`heads x v_head_dim`). The shared latents (`q_a_proj`, `kv_a_proj_with_mqa` and their norms) stay
replicated; the rope part of `kv_a_proj_with_mqa` is used by every head, so its gradient is summed
over ranks (`hf_style: mla_kv_a_proj`, as in transformers' DeepSeek-V2 plan).

`num_attention_heads` is read as every derived plan reads it (`ConfigSizes`: config.json, else the
config class's default): a value that is not a positive integer (0, -4, "4") is one `ManifestError`
naming the field, never a silent fallback to replicating everything.
"""

from __future__ import annotations

import re
from typing import Any

from reshard.rules.manifest import Rule, register_config_rules
from reshard.rules.tp_plans.derive import ConfigSizes
from reshard.rules.tp_plans.entry import PlanEntry, table_entry

_PER_HEAD = {"q_b_proj": "column", "q_proj": "column", "kv_b_proj": "column", "o_proj": "row",
             "kv_a_proj_with_mqa": "replicate"}
_ATTN = re.compile(r"(?P<pre>.*\.self_attn)\.(?P<leaf>[a-z_]+)\.(weight|bias)")


@register_config_rules
def mla_head_rules(config: dict[str, Any], names: list[str]) -> list[Rule]:
    if not config.get("kv_lora_rank"):
        return []  # not MLA: the settings are not read
    from reshard.settings import library_settings

    if library_settings().mla != "heads":
        return []
    model_type = str(config.get("model_type"))
    entry = table_entry(model_type) or PlanEntry(model_type=model_type, base_plan={})
    heads = ConfigSizes(entry, config)["heads"]  # a positive integer, else one ManifestError naming the field
    if heads is None:
        return []
    leaves = {m.group("leaf") for n in names if (m := _ATTN.fullmatch(n))}
    rules = []
    for leaf, kind in _PER_HEAD.items():
        if leaf not in leaves:
            continue
        options: dict[str, Any] = {"heads": heads} if kind == "column" else {}
        if kind == "replicate":
            options = {"hf_style": "mla_kv_a_proj"}
        rules.append(Rule(rf"(.*\.)?self_attn\.{leaf}\.(weight|bias)", kind, options, regex=True))
    return rules

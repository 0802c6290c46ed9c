"""transformers' TP styles -> reshard kinds, with the options transformers leaves implicit.

How transformers shards a parameter of `ndim` dims under each style (its `shard_param`), and the kind
that holds the same bytes:

| style                                           | transformers' placement             | reshard kind                     |
|-------------------------------------------------|-------------------------------------|----------------------------------|
| colwise, colwise_rep, colwise_gather_output     | Shard(ndim-2) (bias: Shard(0))      | column (fused experts: expert_column) |
| unit_colwise (transformers 5.25: q/k/v by whole heads, replicated where fewer heads than ranks) | Shard(ndim-2) on a heads x replicas mesh | column (heads: as kv heads) |
| rowwise, rowwise_rep, rowwise_split_input       | Shard(-1), bias replicated          | row (fused experts: expert_row)  |
| packed_colwise                                  | _StridedShard(ndim-2, split_factor=2) | packed_column parts=2 / expert_column parts=2 |
| packed_rowwise                                  | _StridedShard(-1, split_factor=2)   | packed_row parts=2 / expert_row parts=2 |
| embedding_rowwise                               | Shard(0)                            | vocab_embed (pad)                |
| embedding_colwise                               | Shard(1)                            | embed_hidden                     |
| replicate, replicated_with_grad_allreduce, mla_kv_a_proj, all_reduce, moe_tp_experts, moe_identity_expert, local_params, sequence_parallel | no shard (a forward/gradient hook) | replicate (`hf_style` option says which hook) |

Two deliberate differences. `colwise` on a fused experts `gate_up_proj` (Inkling's plans) would give
rank 0 all of gate and rank 1 all of up; reshard splits each block (`expert_column` `parts: 2`, like
`packed_colwise`). `colwise_gather_output` on a fused `qkv_proj` / `gate_up_proj` (Phi-3)
splits the tensor as one block and gathers the output; reshard splits every block on its own
(`packed_column` with the block sizes from config.json), so attention and the MLP run sharded, and
the paired `rowwise_split_input` becomes a plain `row`. The same holds for `colwise_gather_output`
on separate q/k/v (OLMoE): there the bytes are the same as transformers'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.errors import ManifestError

# unit_colwise (transformers 5.25's UnitColwiseParallel): whole heads per rank, each head replicated over tp // heads
# ranks where there are fewer heads than ranks: what `column` with its heads option holds
COLWISE = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "unit_colwise"})
ROWWISE = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input"})
HOOK_ONLY = frozenset({"replicate", "replicated_with_grad_allreduce", "mla_kv_a_proj", "all_reduce", "moe_tp_experts",
                       "moe_identity_expert", "local_params", "sequence_parallel"})
KNOWN_STYLES = COLWISE | ROWWISE | HOOK_ONLY | {"packed_colwise", "packed_rowwise", "embedding_rowwise",
                                                "embedding_colwise"}

# fused or per-head projections whose gathered colwise output reshard keeps sharded, and their row partners
SHARDED_GATHER = frozenset({"qkv_proj", "gate_up_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARTNERS = {"o_proj": ("qkv_proj", "q_proj"), "down_proj": ("gate_up_proj", "up_proj", "gate_proj")}
Q_HEADS = frozenset({"q_proj", "query_key_value", "q_b_proj", "kv_b_proj", "sinks"})
KV_HEADS = frozenset({"k_proj", "v_proj"})

Kind = tuple[str, dict[str, Any]]


class StyleMapper:
    """Maps (style, where it applies) to a reshard kind and options for one architecture's config."""

    def __init__(self, *, model_type: str, sizes: Mapping[str, Any], base_plan: dict[str, str]) -> None:
        """`sizes`: heads, kv_heads, head_dim, intermediate_size (`reshard.rules.tp_plans.derive.ConfigSizes`:
        read from config.json and checked when first looked up)."""
        self.model_type, self.sizes, self.base_plan = model_type, sizes, base_plan

    def check(self, key: str, style: Any) -> None:
        if not isinstance(style, str) or style not in KNOWN_STYLES:
            raise ManifestError(
                f"model_type {self.model_type!r}: TP plan entry {key!r} uses style {style!r}, which reshard cannot "
                f"honour; write a rules file (--rules FILE or reshard-rules.yaml) that says how to split it"
            )

    # -- the three places a style applies ---------------------------------------------------------------

    def for_module(self, key: str, style: str, *, lm_head: bool = False) -> Kind:
        """A module's `.weight` / `.bias` (a linear or an embedding)."""
        self.check(key, style)
        leaf = key.rsplit(".", 1)[-1]
        if style in HOOK_ONLY:
            return "replicate", {"hf_style": style}
        if style == "embedding_rowwise":
            return "vocab_embed", {"pad": True}
        if style == "embedding_colwise":
            return "embed_hidden", {}
        if style == "packed_colwise":
            return "packed_column", {"parts": 2}
        if style == "packed_rowwise":
            return "packed_row", {"parts": 2}
        if style in ROWWISE:
            if style == "rowwise_split_input" and not self._partner_sharded(key, leaf):
                return "row", {"split_input": True}
            return "row", {}
        # colwise family
        if lm_head:
            return "column", {"pad": True, "gather_output": True}
        if style == "colwise_gather_output":
            if leaf not in SHARDED_GATHER:
                return "column", {"gather_output": True}
            if leaf in ("qkv_proj", "gate_up_proj"):
                return "packed_column", self._packed_blocks(key, leaf)
        return "column", self._heads(leaf)

    def for_param(self, key: str, style: str) -> Kind:
        """A parameter the plan names itself (fused MoE experts `[E, out, in]`, attention sinks)."""
        self.check(key, style)
        leaf = key.rsplit(".", 1)[-1]
        if style in HOOK_ONLY:
            return "replicate", {"hf_style": style}
        if style.startswith("embedding_"):
            return self.for_module(key, style)
        if leaf == "sinks" and style in COLWISE:
            return "column", self._heads(leaf)
        if style in COLWISE and leaf == "gate_up_proj":
            # a fused gate|up under plain colwise (Inkling's plans): transformers' Shard(1) hands rank 0 all of
            # gate and rank 1 all of up, which the experts' `chunk(2)` then misreads; split each block instead,
            # as `packed_colwise` does for every other MoE plan
            return "expert_column", {"parts": 2}
        if style in COLWISE or style == "packed_colwise":
            return "expert_column", ({"parts": 2} if style == "packed_colwise" else {})
        if style == "rowwise" and leaf == "bias":
            return "replicate", {"hf_style": style}
        return "expert_row", ({"parts": 2} if style == "packed_rowwise" else {})

    def for_expert_slice(self, key: str, style: str) -> Kind:
        """One expert's slice `[out, in]` of a fused parameter the plan names (transformers stacks them on load):
        the fused parameter's dim d is this tensor's dim d-1, split contiguously (also under `packed_*`)."""
        self.check(key, style)
        if style in HOOK_ONLY:
            return "replicate", {"hf_style": style}
        if style in COLWISE or style == "packed_colwise":
            return "column", {}
        if style in ROWWISE or style == "packed_rowwise":
            return "row", {}
        return self.for_module(key, style)

    # -- implicit options from config.json ----------------------------------------------------------------

    def _partner_sharded(self, key: str, leaf: str) -> bool:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        for sibling in ROW_PARTNERS.get(leaf, ()):
            if self.base_plan.get(f"{parent}.{sibling}" if parent else sibling) == "colwise_gather_output":
                return sibling in SHARDED_GATHER
        return False

    def _heads(self, leaf: str) -> dict[str, Any]:
        """Head options of a per-head projection; each config value is read (and checked) only where used."""
        if leaf in Q_HEADS:
            heads = self.sizes.get("heads")
            return {"heads": heads} if heads else {}
        if leaf in KV_HEADS:
            kv = self.sizes.get("kv_heads")
            return {"heads": kv, "replicate_heads": True} if kv else {}
        return {}

    def _packed_blocks(self, key: str, leaf: str) -> dict[str, Any]:
        """Block sizes of a fused q|k|v or gate|up (split per block, see the module docstring)."""
        s = self.sizes
        if leaf == "qkv_proj":
            if not (s.get("heads") and s.get("kv_heads") and s.get("head_dim")):
                raise ManifestError(
                    f"config.json: cannot derive attention sizes for {key!r} (num_attention_heads="
                    f"{s.get('heads')}, num_key_value_heads={s.get('kv_heads')}, head_dim={s.get('head_dim')}); "
                    f"fix config.json or write a rules file")
            h, kv, hd = s["heads"], s["kv_heads"], s["head_dim"]
            return {"blocks": [h * hd, kv * hd, kv * hd], "heads": [h, kv, kv], "replicate_heads": [False, True, True]}
        if not s.get("intermediate_size"):
            raise ManifestError(f"config.json tp_plan: {key!r} is packed_column but its block sizes are unknown "
                                f"(intermediate_size={s.get('intermediate_size')}); write a rules file")
        return {"blocks": [s["intermediate_size"]] * 2}

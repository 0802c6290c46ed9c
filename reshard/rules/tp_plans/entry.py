"""One architecture's TP plan as reshard reads it: from installed transformers, or the shipped table.

A `PlanEntry` holds what transformers declares for a `model_type`: the config class's
`base_model_tp_plan`, the CausalLM class's `_tp_plan` (the `lm_head`), the base-model prefix the
checkpoint's names carry, the config's `attribute_map` and defaults for the sizes reshard reads, and
the checkpoint conversion mapping (`transformers.conversion_mapping`) that turns on-disk names (per-expert
MoE tensors) into the in-memory parameters the plan names, and the pipeline and expert-parallel plans
(`base_model_pp_plan`'s modules, `base_model_ep_plan`). Both sources give the same dataclass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("table.json")

# config attributes the implicit options read (head counts, sizes); the table stores their class defaults
SIZE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "intermediate_size",
             "vocab_size", "tie_word_embeddings")


@dataclass(frozen=True)
class PlanEntry:
    """What transformers declares for one `model_type` (see the module docstring)."""

    model_type: str
    base_plan: dict[str, str]
    lm_plan: dict[str, str] = field(default_factory=dict)
    prefix: str = "model"
    attribute_map: dict[str, str] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    conversion: list[dict[str, Any]] = field(default_factory=list)
    pp_plan: list[str] = field(default_factory=list)  # the base model's modules `base_model_pp_plan` names
    ep_plan: dict[str, str] = field(default_factory=dict)  # `base_model_ep_plan`: module or parameter -> style
    buffers: list[str] = field(default_factory=list)  # persistent buffers (FSDP leaves them whole), `*` for layers

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["model_type"]
        return out

    @classmethod
    def from_dict(cls, model_type: str, obj: dict[str, Any]) -> PlanEntry:
        return cls(model_type=model_type, **obj)

    def full_plan(self) -> dict[str, str]:
        """The plan of the CausalLM model, keyed by full in-memory names, as transformers assembles it:
        `embed_tokens` vocab-sharded unless named, the base plan under the prefix, then the head's plan."""
        base = dict(self.base_plan)
        if base and "embed_tokens" not in base:
            base = {"embed_tokens": "embedding_rowwise", **base}
        pre = f"{self.prefix}." if self.prefix else ""
        return {**{pre + k: v for k, v in base.items()}, **self.lm_plan}

    def stand_in_names(self) -> list[str]:
        """Tensor names standing for the plan when a checkpoint's are not at hand: each plan key at layer 0,
        its `.weight` and `.bias`, or the key itself where it names a parameter (fused experts, sinks)."""
        names = []
        for key in self.full_plan():
            key = key.replace("*", "0")
            parent, _, leaf = key.rpartition(".")
            if parent.endswith("experts") or leaf == "sinks":
                names.append(key)
            else:
                names += [f"{key}.weight", f"{key}.bias"]
        return names

    def config_value(self, config: dict[str, Any], key: str) -> Any:
        """`key` from config.json, through the config class's attribute_map, else the class default."""
        for name in (key, self.attribute_map.get(key)):
            if name and name in config:
                return config[name]
        return self.defaults.get(key)


@lru_cache(maxsize=1)
def load_table() -> dict[str, Any]:
    """The shipped table: {"transformers_version": ..., "plans": {model_type: entry dict}}."""
    return json.loads(TABLE_PATH.read_text(encoding="utf-8"))


def table_entry(model_type: str) -> PlanEntry | None:
    obj = load_table()["plans"].get(model_type)
    return None if obj is None else PlanEntry.from_dict(model_type, obj)


def table_version() -> str:
    return str(load_table()["transformers_version"])

"""A `PlanEntry` + config.json + the checkpoint's tensor names -> manifest rules in the checkpoint's own names.

Each disk tensor goes through the conversion mapping to the in-memory parameter transformers loads it
into; the plan entry for that parameter (or its module, as transformers looks them up) gives the style,
`StyleMapper` the kind. Rules are written back in disk names with layer and expert numbers generalized
(`\\d+`), so the manifest stays one rule per distinct tensor role.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from reshard.errors import ManifestError
from reshard.rules.manifest import Rule
from reshard.rules.tp_plans.convert import Conversion
from reshard.rules.tp_plans.entry import PlanEntry
from reshard.rules.tp_plans.styles import StyleMapper

_NUMBER = re.compile(r"\.\d+(?=\.|$)")
# conversion ops that only drop rows (dim 0): a split of another dim holds the same columns of every row kept
DIM0_ONLY_OPS = frozenset({"Inkling2UnpadVocab"})
SPLIT_OFF_DIM0 = frozenset({"row", "packed_row", "embed_hidden"})


def wildcard(name: str) -> str:
    """transformers' `replace_layer_number_by_wildcard`: `.3.` -> `.*.`."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def generalize(name: str) -> str:
    """A regex matching `name` with every module number free."""
    parts = _NUMBER.split(name)
    return r"\.\d+".join(re.escape(p) for p in parts)


class ConfigSizes(Mapping[str, Any]):
    """The sizes the implicit options read (`heads`, `kv_heads`, `head_dim`, `intermediate_size`), from
    config.json through the config class's attribute_map and defaults. Each is checked when a rule
    needs it: a positive integer that divides what it must, else one `ManifestError` naming the field.
    An absent (or null) value is None: the option is left out, as transformers' defaults do."""

    KEYS = ("heads", "kv_heads", "head_dim", "intermediate_size")

    def __init__(self, entry: PlanEntry, config: dict[str, Any]) -> None:
        self.entry, self.config = entry, config
        self._got: dict[str, int | None] = {}

    def __getitem__(self, key: str) -> int | None:
        if key not in self.KEYS:
            raise KeyError(key)
        if key not in self._got:
            self._got[key] = getattr(self, f"_{key}")()
        return self._got[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    def _field(self, key: str) -> tuple[str, Any]:
        """(how to name the field in an error, its value), as `PlanEntry.config_value` finds it."""
        for name in (key, self.entry.attribute_map.get(key)):
            if name and name in self.config:
                return f"config.json `{name}`", self.config[name]
        return f"`{key}` (the default of model_type {self.entry.model_type!r})", self.entry.defaults.get(key)

    def _positive(self, key: str, use: str) -> tuple[str, int | None]:
        where, value = self._field(key)
        if value is not None and (type(value) is not int or value <= 0):
            raise ManifestError(
                f"{where} = {value!r} ({type(value).__name__}) must be a positive integer: reshard {use} with it; "
                f"fix config.json or write a rules file")
        return where, value

    def _heads(self) -> int | None:
        return self._positive("num_attention_heads", "splits attention projections on head boundaries")[1]

    def _kv_heads(self) -> int | None:
        where, kv = self._positive("num_key_value_heads", "splits k_proj / v_proj on kv-head boundaries")
        heads = self["heads"]
        if kv is None:
            return heads
        if heads is not None and heads % kv:
            raise ManifestError(
                f"{where} = {kv} does not divide num_attention_heads = {heads} (each kv head serves "
                f"num_attention_heads / num_key_value_heads query heads); fix config.json or write a rules file")
        return kv

    def _head_dim(self) -> int | None:
        head_dim = self._positive("head_dim", "sizes the blocks of a fused qkv_proj")[1]
        heads = self["heads"]
        if head_dim is not None or heads is None:
            return head_dim
        where, hidden = self._positive("hidden_size", "derives head_dim (absent) from it")
        if hidden is None:
            return None
        if hidden % heads:
            raise ManifestError(
                f"{where} = {hidden} is not a multiple of num_attention_heads = {heads}, and config.json has no "
                f"head_dim: the head size is unknown; set head_dim in config.json or write a rules file")
        return hidden // heads

    def _intermediate_size(self) -> int | None:
        return self._positive("intermediate_size", "sizes the blocks of a fused gate_up_proj")[1]


def attention_sizes(entry: PlanEntry, config: dict[str, Any]) -> ConfigSizes:
    """The sizes the implicit options read from config.json, each checked when first read."""
    return ConfigSizes(entry, config)


class PlanRules:
    """Derives the rules of one checkpoint from its architecture's plan entry."""

    def __init__(self, entry: PlanEntry, config: dict[str, Any]) -> None:
        self.entry = entry
        base = dict(entry.base_plan)
        if base and "embed_tokens" not in base:  # transformers vocab-shards embed_tokens unless the plan names it
            base = {"embed_tokens": "embedding_rowwise", **base}
        self.base, self.lm = base, dict(entry.lm_plan)
        self.mapper = StyleMapper(model_type=entry.model_type, sizes=attention_sizes(entry, config), base_plan=base)
        self.convert = Conversion(entry.conversion)
        for key, style in {**base, **self.lm}.items():
            self.mapper.check(key, style)

    def _lookup(self, name: str) -> tuple[str, str, bool, bool] | None:
        """(plan key, style, the key names the parameter itself, from the head's plan) for an in-memory name."""
        generic = wildcard(name)
        candidates = [(generic, self.lm, True)]
        prefix = self.entry.prefix
        first, _, rest = generic.partition(".")
        if rest and first in {prefix, "model"}:
            candidates.append((rest, self.base, False))
        candidates.append((generic, self.base, False))
        for key, plan, is_lm in candidates:
            if key in plan:
                return key, plan[key], True, is_lm
            module = key.rsplit(".", 1)[0] if "." in key else None
            if module is not None and module in plan:
                return module, plan[module], False, is_lm
        return None

    def kind_for(self, disk_name: str) -> tuple[str, dict[str, Any]] | None:
        """The kind (and options) of one disk tensor, or None when the plan leaves it alone (replicated)."""
        conv = self.convert(disk_name)
        hit = self._lookup(conv.name)
        if hit is None:
            return None
        key, style, names_param, is_lm = hit
        if not names_param and not conv.name.endswith((".weight", ".bias")):
            return None  # another tensor of a planned module (an FP8 scale): `reshard.rules.quant` places it
        if conv.per_expert and names_param:
            kind = self.mapper.for_expert_slice(key, style)
        elif names_param and not conv.name.endswith((".weight", ".bias")):
            kind = self.mapper.for_param(key, style)
        else:
            kind = self.mapper.for_module(key, style, lm_head=is_lm)
        other = [op for op in conv.other_ops if not (op in DIM0_ONLY_OPS and kind[0] in SPLIT_OFF_DIM0)]
        if other and kind[0] != "replicate":
            raise ManifestError(
                f"model_type {self.entry.model_type!r}: {disk_name} becomes {conv.name} through transformers' "
                f"conversion ops {other}, which reshard cannot follow to split it ({style!r} on "
                f"{key!r}); write a rules file for it")
        return kind

    def rules(self, names: Iterable[str]) -> list[Rule]:
        by_pattern: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
        for name in names:
            got = self.kind_for(name)
            if got is not None:
                by_pattern.setdefault(generalize(name), []).append((name, *got))
        rules = []
        for pattern, items in by_pattern.items():
            kinds = {(k, repr(sorted(o.items()))) for _, k, o in items}
            if len(kinds) == 1:
                rules.append(Rule(pattern, items[0][1], items[0][2], regex=True))
            else:  # layers differ (per-layer head counts): one rule per tensor
                rules.extend(Rule(re.escape(n), k, o, regex=True) for n, k, o in items)
        return rules

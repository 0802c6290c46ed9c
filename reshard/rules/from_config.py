"""A checkpoint's manifest when no rules are given: a rules file beside it, else derived from config.json.

The TP plan of the architecture (`reshard.rules.tp_plans`: config.json's own plan, the installed
transformers, or the shipped table) gives the rules; every hook registered with
`reshard.rules.manifest.register_config_rules` may add rules derived from config.json; quantized
checkpoints' scales follow their weights (`reshard.rules.quant`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reshard.errors import ManifestError
from reshard.rules.manifest import CONFIG_RULE_HOOKS, Manifest
from reshard.rules.quant.rules import logical_names, quantized_rules
from reshard.rules.tp_plans import resolve_plan
from reshard.rules.tp_plans.derive import PlanRules


def from_config(config: dict[str, Any], tensor_names: Iterable[str] = ()) -> Manifest:
    """Rules for a checkpoint from its config.json alone; `Manifest.source` names the plan used.

    Every tensor is named as on disk (per-expert MoE tensors included, reached through transformers'
    conversion mapping); see `reshard.rules.tp_plans` for where plans come from and `reshard.rules.tp_plans.styles`
    for what each transformers style becomes.
    """
    entry, source = resolve_plan(config)
    names = list(tensor_names) or entry.stand_in_names()
    rules = PlanRules(entry, config).rules(names + logical_names(config, names))
    extra = [r for hook in CONFIG_RULE_HOOKS for r in hook(config, names)]

    return Manifest(tuple(quantized_rules(extra + rules, config, names)), False, source)


RULES_FILES = ("reshard-rules.yaml", "reshard-rules.yml", "reshard-rules.json")


def resolve_manifest(
    root: Path, config: dict[str, Any] | None, tensor_names: Iterable[str], rules: str | Path | None = None
) -> Manifest:
    """The manifest for a checkpoint: `rules` if given, else a rules file in its directory, else config.json."""
    if rules is not None:
        return Manifest.load(rules)
    for name in RULES_FILES:
        if (Path(root) / name).is_file():
            return Manifest.load(Path(root) / name)
    if config is None:
        raise ManifestError(f"{root}: no --rules given, no {RULES_FILES[0]} and no config.json to derive a plan from")
    return from_config(config, tensor_names)

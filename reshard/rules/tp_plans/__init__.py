"""TP plans by model_type: read from the installed transformers, else from a table shipped here.

`resolve_plan(config)` returns the plan entry for a config.json and a line naming where it came from,
in this order: `base_model_tp_plan` inside config.json (the architecture's entry gives prefix and
conversion mapping); the shipped table `table.json`, generated from transformers by
`scripts/gen_plan_table.py` (it records the version); the installed transformers' plans only when
`RESHARD_PLAN_SOURCE` says `live` (or `auto`), so a rank's bytes do not depend on what is installed.
Rules files (`--rules`, `reshard-rules.*`) come before all of these, in `reshard.rules.manifest`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from reshard.errors import ManifestError
from reshard.rules.tp_plans import mla as _mla  # noqa: F401  (registers the optional MLA-by-heads config rules)
from reshard.rules.tp_plans.entry import PlanEntry, load_table, table_entry, table_version
from reshard.rules.tp_plans.live import live_entry, transformers_version
from reshard.settings import env_name, library_settings

__all__ = ["PlanEntry", "resolve_plan", "entry_for", "table_entry", "live_entry", "load_table"]

# `reshard.settings` plan_source: "table" (the default) reads the shipped table only, so what a rank gets never
# depends on the transformers installed beside reshard (an older one, pinned by vLLM, may plan MoE experts
# otherwise); "live" always reads the installed transformers; "auto" reads it when its version differs
# from the table's (the same version's plans are the table, byte for byte, as tests/rules/tp_plans checks)
SOURCE_ENV = env_name("plan_source")


def _plan_source() -> str:
    """LibrarySettings.plan_source; `entry_for` checks the value."""
    return library_settings().plan_source


def entry_for(model_type: str) -> tuple[PlanEntry | None, str]:
    """The plan entry for `model_type` and its source line (the shipped table unless told otherwise)."""
    mode = _plan_source()
    if mode not in ("auto", "live", "table"):
        raise ManifestError(f"{SOURCE_ENV}={mode!r}: expected table, live or auto")
    installed = transformers_version() if mode != "table" else None
    if installed is not None and (mode == "live" or installed != table_version()):
        entry = live_entry(model_type)
        if entry is not None:
            return entry, f"transformers {installed} plan for model_type {model_type!r}"
    entry = table_entry(model_type)
    if transformers_version() == table_version():
        return entry, f"transformers {table_version()} plan for model_type {model_type!r} (the shipped table of that version)"
    return entry, f"shipped plan table (transformers {table_version()}) for model_type {model_type!r}"


def resolve_plan(config: dict[str, Any]) -> tuple[PlanEntry, str]:
    """The plan entry for a config.json, and which source it came from (see the module docstring)."""
    model_type = config.get("model_type")
    entry, source = entry_for(model_type) if isinstance(model_type, str) else (None, "")
    own = config.get("base_model_tp_plan")
    if isinstance(own, dict) and own:
        base = entry or PlanEntry(model_type=str(model_type), base_plan={}, lm_plan={"lm_head": "colwise_gather_output"})
        return dataclasses.replace(base, base_plan=dict(own)), "config.json base_model_tp_plan"
    if entry is None:
        live = _plan_source() != "table" and transformers_version()
        where = f", none in transformers {live}" if live else ""
        also = "" if live or not transformers_version() else (
            f", or set {SOURCE_ENV}=live to use the plans of the installed transformers {transformers_version()}")
        raise ManifestError(
            f"config.json: model_type {model_type!r} has no TP plan anywhere (no base_model_tp_plan in config.json"
            f"{where}, none in the shipped table of {len(load_table()['plans'])} architectures from "
            f"transformers {table_version()}); write a rules file: put reshard-rules.yaml in the checkpoint "
            f"directory or pass --rules FILE (see docs/manifest.md){also}"
        )
    return entry, source

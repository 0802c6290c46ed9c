"""Read a `PlanEntry` from the installed transformers (the same data `scripts/gen_plan_table.py` ships)."""

from __future__ import annotations

import contextlib
import io
import warnings
from functools import lru_cache
from typing import Any

from reshard.rules.tp_plans.entry import SIZE_KEYS, PlanEntry

# conversion ops reshard follows for sharding (stacking experts, concatenating gate|up); others are recorded
# by name and only matter if a sharded parameter comes from them
_KNOWN_OPS = {"MergeModulelist": "dim", "Concatenate": "dim"}


def installed_version(distribution: str) -> str | None:
    """An installed distribution's version, from its package metadata (no import), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def transformers_version() -> str | None:
    """The installed transformers' version, from its package metadata (no import), or None."""
    return installed_version("transformers")


def _quiet_import() -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        import transformers
    return transformers


def plan_model_types() -> list[str]:
    """Every model_type whose config class declares a `base_model_tp_plan`, in transformers' order."""
    transformers = _quiet_import()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for model_type, class_name in CONFIG_MAPPING_NAMES.items():
        cls = getattr(transformers, class_name, None)
        if cls is not None and getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def _causal_lm_class(model_type: str) -> Any:
    transformers = _quiet_import()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    for names in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        name = names.get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name:
            with contextlib.suppress(Exception):
                cls = getattr(transformers, name)
                return cls, names is MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return None, False


def serialize_conversion(model_type: str, class_name: str | None = None) -> list[dict[str, Any]]:
    """transformers' checkpoint conversion mapping for the model class (else `model_type`), as transformers
    looks it up on load, as plain data (patterns as transformers processed them, ops by name and dim)."""
    _quiet_import()
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = (get_checkpoint_conversion_mapping(class_name) if class_name else None)
    if transforms is None:
        transforms = get_checkpoint_conversion_mapping(model_type)
    out: list[dict[str, Any]] = []
    for t in transforms or []:
        item: dict[str, Any] = {"source": list(t.source_patterns), "target": list(t.target_patterns)}
        if isinstance(t, WeightConverter):
            ops = []
            for op in t.operations:
                name = type(op).__name__
                ops.append([name, getattr(op, _KNOWN_OPS[name])] if name in _KNOWN_OPS else [name, None])
            item.update(type="convert", ops=ops)
        elif type(t) is WeightRenaming:
            item["type"] = "rename"
        else:  # a renaming with its own logic (prefix changes, layer collapses): named, not followed
            item["type"] = type(t).__name__
        out.append(item)
    return out


@lru_cache(maxsize=512)
def live_entry(model_type: str) -> PlanEntry | None:
    """The entry transformers declares for `model_type`, or None (no transformers, no plan); read once per
    process (building each architecture on meta for its persistent buffers costs ~0.1 s)."""
    try:
        transformers = _quiet_import()
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return None
    config_cls = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)
    plan = getattr(config_cls, "base_model_tp_plan", None) if config_cls is not None else None
    if not plan:
        return None
    model_cls, is_lm = _causal_lm_class(model_type)
    lm_plan = dict(getattr(model_cls, "_tp_plan", None) or {}) if is_lm else {}
    prefix = str(getattr(model_cls, "base_model_prefix", "model") or "") if is_lm else ""
    defaults: dict[str, Any] = {}
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_cls()
        defaults = {k: getattr(config, k) for k in SIZE_KEYS if isinstance(getattr(config, k, None), (int, bool))}
    return PlanEntry(
        model_type=model_type, base_plan=dict(plan), lm_plan=lm_plan, prefix=prefix,
        attribute_map=dict(getattr(config_cls, "attribute_map", {}) or {}), defaults=defaults,
        conversion=serialize_conversion(model_type, model_cls.__name__ if model_cls is not None else None),
        pp_plan=list(getattr(config_cls, "base_model_pp_plan", None) or {}),
        ep_plan=dict(getattr(config_cls, "base_model_ep_plan", None) or {}),
        buffers=persistent_buffers(model_cls, config_cls),
    )


def persistent_buffers(model_cls: Any, config_cls: Any) -> list[str]:
    """The model's persistent buffers (in its state dict, not parameters: FSDP does not shard them), layer
    numbers as `*`, from the class built on the meta device with the config's defaults ([] if it cannot be)."""
    import torch

    from reshard.rules.tp_plans.derive import wildcard

    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = model_cls(config_cls())
    except Exception:  # noqa: BLE001 - a config class whose defaults do not build: none known
        return []
    skip = {f"{m}.{b}" if m else b for m, mod in model.named_modules() for b in getattr(mod, "_non_persistent_buffers_set", ())}
    return sorted({wildcard(n) for n, _ in model.named_buffers() if n not in skip})

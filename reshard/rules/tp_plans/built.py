"""transformers' own model for a config.json, built on the meta device (no memory, no weights read), and
what it says about a checkpoint: every tensor's shape under the names on disk.

    model = meta_model(hf_config(config), dtype=torch.float32)      # the trainer's and `fill_model`'s model
    model_shapes(config, names)     # {name on disk: the shape the model gives it}, for `reshard merge`

Names on disk reach the model's through transformers' conversion mapping, as on load
(`reshard.rules.tp_plans.convert`): renamed ones (Mixtral's `block_sparse_moe.gate`) take the renamed
parameter's shape, per-expert ones that transformers fuses (`experts.N.gate_proj`, `up_proj` ->
`experts.gate_up_proj` [E, gate+up, H]) one expert's block of it. torch and transformers are imported
only when a model is built; its shapes are kept in this user's cache, per config and transformers version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from reshard.cachedir import cache_dir
from reshard.errors import CheckpointError, require
from reshard.format.checkpoint import parse_json
from reshard.rules.tp_plans.convert import Conversion, Converted
from reshard.rules.tp_plans.live import installed_version, transformers_version

if TYPE_CHECKING:
    import torch
    from torch import nn


def hf_config(config: dict[str, Any]) -> Any:
    """The transformers config object for a config.json dict (`model_type` picks the class)."""
    require("transformers", what="building a transformers model (the trainer, empty_tp_model)")
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"config.json: model_type {model_type!r} is not a transformers architecture "
            f"(transformers knows {len(CONFIG_MAPPING)} model types, e.g. llama, qwen3, mixtral)"
        )
    return CONFIG_MAPPING[model_type].from_dict(dict(config))


def meta_model(config: Any, *, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """`AutoModelForCausalLM.from_config` on the meta device, with weight initialization switched off; a tied
    head is the embedding's Parameter, as `from_pretrained` leaves it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        with torch.device("meta"), no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    except ValueError as e:  # transformers: "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise CheckpointError(
            f"config.json: model_type {config.model_type!r} has no causal-LM class in transformers: "
            f"{str(e).splitlines()[0]}"
        ) from None
    model.tie_weights()
    return model


def model_shapes(config: dict[str, Any] | None, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The shape transformers' model of `config` gives each of `names` (names on disk), for those it has;
    {} where there is no model to ask: no config or `model_type`, a quantized checkpoint (`quantization_config`:
    its packed tensors are stored in other shapes), no torch or transformers, an architecture it cannot build."""
    if not config or not isinstance(config.get("model_type"), str) or config.get("quantization_config"):
        return {}
    state = _state_shapes(config)
    if not state:
        return {}
    from reshard.rules.tp_plans import entry_for

    entry, _ = entry_for(config["model_type"])
    convert = Conversion(entry.conversion if entry is not None else [])
    out = {}
    for name in names:
        shape = state.get(name) or _converted_shape(convert(name), state)
        if shape is not None:
            out[name] = shape
    return out


def _state_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every state-dict tensor's shape of the model of `config` ({} where it cannot be built), kept in this
    user's cache (`cache_dir("model-shapes")`) under the digest of the config and transformers' version:
    a process that finds it there imports neither torch nor transformers (about 4 s, 12 s on a busy machine)."""
    if transformers_version() is None or installed_version("torch") is None:
        return {}  # told by package metadata: a base install never tries to import either
    key = hashlib.sha256(json.dumps([config, transformers_version()], sort_keys=True, default=str).encode()).hexdigest()
    dest = cache_dir("model-shapes") / f"{key}.json"
    with contextlib.suppress(OSError, CheckpointError):
        kept = parse_json(dest.read_bytes(), str(dest))
        if isinstance(kept, dict) and all(isinstance(v, list) and all(type(x) is int for x in v) for v in kept.values()):
            return {str(n): tuple(v) for n, v in kept.items()}
    try:
        import torch

        model = meta_model(hf_config(config), dtype=torch.float32)
    except Exception:  # noqa: BLE001  no torch or transformers, an unknown or unbuildable architecture
        return {}
    state = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(state))
        os.replace(tmp, dest)
    except OSError:  # a cache that cannot be written: computed again next time
        with contextlib.suppress(OSError):
            tmp.unlink()
    return state


def _converted_shape(c: Converted, state: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape of a renamed tensor, or one expert's block of a fused one (None: not the model's, or a
    conversion reshard does not follow)."""
    shape = state.get(c.name)
    if shape is None or c.other_ops or not c.per_expert:
        return None if c.other_ops else shape
    per = list(shape[1:])
    if c.concat is not None:
        if c.concat >= len(per) or per[c.concat] % c.sources:
            return None
        per[c.concat] //= c.sources
    return tuple(per)


__all__ = ["hf_config", "meta_model", "model_shapes"]

"""A transformers TP model with no weights read: the steps `from_pretrained(tp_plan="auto")` takes,
minus loading the checkpoint, so that `fill_model` can fill it from a rank shard.

    model = empty_tp_model("http://HOST:PORT/v1/checkpoints/NAME")    # or a directory, or a config
    fill_model(model, "http://HOST:PORT/v1/checkpoints/NAME")

transformers 5.24 has no public "build me an empty TP model" call. `from_pretrained` does, in order:
`prepare_distribute_model` (the device mesh), build the model on the meta device,
`maybe_distribute_model` (its `tp_plan` turned into DTensor parameters, still on meta), load the
weights, then materialize what was not loaded and initialize non-persistent buffers. The first three
are public methods of `PreTrainedModel`, called here as `from_pretrained` calls them; then the model is
materialized with `to_empty` and its non-persistent buffers (rotary `inv_freq`) recomputed the way
transformers does after a distributed-checkpoint load: every parameter is marked initialized and
`initialize_weights()` runs (it then touches only the buffers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reshard import importcache
from reshard.errors import CheckpointError, require
from reshard.format.checkpoint import CONFIG_NAME
from reshard.io.client.body import get_json
from reshard.io.client.wire import checkpoint_url, redact
from reshard.io.source.stores import is_url
from reshard.rules.tp_plans.built import hf_config, meta_model
from reshard.tp.comm import tp_world_size


def source_config(source: str | Path, *, token: str | None = None) -> dict[str, Any]:
    """config.json of a checkpoint or shard directory, of a rank file's directory, or from the service."""
    if is_url(source):
        config = get_json(checkpoint_url(str(source)), token=token).get("config")
    else:
        path = Path(source)
        path = (path if path.is_dir() else path.parent) / CONFIG_NAME
        config = json.loads(path.read_text()) if path.is_file() else None
    if not isinstance(config, dict):
        raise CheckpointError(f"{redact(str(source))}: no config.json; pass the model's config instead")
    return config


def empty_tp_model(
    config: str | Path | dict[str, Any] | Any, *, tp: int | None = None, dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu", auto_class: Any = None, token: str | None = None,
) -> nn.Module:
    """transformers' model for `config` (a source as in `source_config`, a config.json dict or a
    `PretrainedConfig`), tensor-parallel by its own `tp_plan` over `tp` ranks (default: the world),
    materialized on `device` with uninitialized parameters. `auto_class` defaults to AutoModelForCausalLM.
    Where transformers is not imported yet, it is imported with reshard's import cache on
    (`reshard.enable_import_cache()`), as reshard's other entry points import it."""
    require("transformers", what="empty_tp_model (a transformers model)")
    importcache.install()  # it imports transformers: without reading its source tree (a no-op once imported)
    import transformers
    from transformers.distributed import DistributedConfig

    if isinstance(config, (str, Path)):
        config = source_config(config, token=token)
    if isinstance(config, dict):
        config = transformers.AutoConfig.for_model(**config)
    auto_class = auto_class or transformers.AutoModelForCausalLM
    tp = tp or tp_world_size()
    with torch.device("meta"):
        model = auto_class.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    cls = type(model)
    if tp > 1:
        distributed, _, mesh = cls.prepare_distribute_model(DistributedConfig(tp_size=tp))
        model = cls.maybe_distribute_model(model, distributed, mesh)
    model.to_empty(device=device)
    init_buffers(model)  # only the non-persistent buffers are left to initialize
    model.tie_weights()
    return model.eval()


def import_model_class(source: str | Path | dict[str, Any], *, token: str | None = None, auto_class: Any = None,
                       warm: bool = True) -> type:
    """Import transformers' config and model classes for `source`'s config.json (a source as in
    `source_config`, or the dict) and return the model class: what a launcher imports once before it
    forks the ranks (`reshard.cli.launch`). With `warm`, a one-layer copy of the model is built on the
    meta device and dropped (no memory, no tensor op): the first build in a process costs ~0.3 s more
    than later ones (lazily imported and first-called code paths), which the ranks then skip."""
    import transformers

    raw = source_config(source, token=token) if isinstance(source, (str, Path)) else source
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{redact(str(source))}: config.json names no transformers architecture: {e}") from None
    auto_class = auto_class or transformers.AutoModelForCausalLM
    cls = auto_class._model_mapping[type(config)]  # imports its module
    if warm:
        _warm_build(raw, auto_class)
    return cls


def _warm_build(raw: dict[str, Any], auto_class: Any) -> None:
    """Build a one-layer copy of the model on meta and drop it (best effort: any failure is ignored)."""
    import transformers

    n = raw.get("num_hidden_layers")
    small = {k: (v[:1] if isinstance(v, list) and n and len(v) == n else v) for k, v in raw.items()}
    small["num_hidden_layers"] = 1
    try:
        with torch.device("meta"):
            auto_class.from_config(transformers.AutoConfig.for_model(**small))
    except Exception:  # noqa: BLE001  an architecture this cannot shrink: the ranks warm up themselves
        pass


def init_buffers(model: nn.Module) -> None:
    """Recompute what the fill did not write (non-persistent buffers), the way `from_pretrained` does.

    Every parameter and persistent buffer was filled from the shard and is flagged so that
    transformers' guarded init functions leave it alone; modules of ours with buffers of their own
    recompute them in `reset_buffers()`.
    """
    for t in model.state_dict(keep_vars=True).values():  # every parameter and persistent buffer
        t._is_hf_initialized = True
    model.initialize_weights()
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


__all__ = ["empty_tp_model", "hf_config", "import_model_class", "init_buffers", "meta_model", "source_config"]

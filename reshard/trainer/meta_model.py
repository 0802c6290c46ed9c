"""The checkpoint's own transformers model, built on the meta device (its buffers are recomputed after
the fill by `reshard.fill.empty_model.init_buffers`).

    config = hf_config(json.loads(Path("config.json").read_text()))   # reshard.fill.empty_model
    model = meta_model(config, dtype=torch.float32)     # no parameter memory, no random init
    ...                                                 # parallelize, to_empty, fill
    init_buffers(model)                                 # rotary inv_freq & co, as from_pretrained does

`init_buffers` is transformers' own mechanism: every filled tensor is flagged `_is_hf_initialized`, then
`model.initialize_weights()` runs each module's `_init_weights`, whose guarded `init.*` calls skip the
flagged tensors and recompute the rest (non-persistent buffers), exactly as after `from_pretrained`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from reshard.errors import CheckpointError


def meta_model(config: Any, *, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """`AutoModelForCausalLM.from_config` on the meta device, with weight initialization switched off."""
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
    model.tie_weights()  # as from_pretrained does: a tied head becomes the embedding's Parameter
    return model


def tied_pair(model: nn.Module) -> tuple[str, str] | None:
    """(output head, input embedding) module names when the model ties their weights, else None."""
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or emb is None or out.weight is not emb.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return names[id(out)], names[id(emb)]


def retie(model: nn.Module, tied: tuple[str, str] | None) -> None:
    """Make the head's weight the embedding's Parameter again (`to_empty` gives each its own tensor)."""
    if tied is not None:
        model.get_submodule(tied[0]).weight = model.get_submodule(tied[1]).weight


__all__ = ["meta_model", "retie", "tied_pair"]

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

from torch import nn

from reshard.fill.empty_model import meta_model


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

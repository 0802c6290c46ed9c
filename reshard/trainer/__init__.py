"""The bundled meta-device TP trainer: the checkpoint's own transformers model, built per rank from its shard.

    from reshard.trainer import build_model
    model = build_model("shards/", device="cpu")      # or "http://HOST:PORT/v1/checkpoints/NAME"
    logits = model(input_ids=ids).logits               # full vocabulary, the same on every rank
"""

from reshard.trainer.build import build_model
from reshard.trainer.loss import causal_lm_loss
from reshard.trainer.save import save_rank_shard

__all__ = ["build_model", "causal_lm_loss", "save_rank_shard"]

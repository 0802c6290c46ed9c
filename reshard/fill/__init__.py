"""Fill any TP model from its rank shard: `fill_model` (plain or DTensor parameters, fused experts),
and `empty_tp_model`, a transformers TP model built without reading weights."""

from reshard.fill.empty_model import empty_tp_model, source_config
from reshard.fill.model import FillReport, fill_model, match_targets

__all__ = ["FillReport", "empty_tp_model", "fill_model", "match_targets", "source_config"]

"""reshard: lazy per-rank tensor-parallel resharding of safetensors checkpoints.

The public API, in the order of the data flow::

    source, manifest = open_source("ckpt/")          # every header validated, the rules resolved
    plan = make_plan(source, manifest, 4)             # pure: what every rank file holds, byte for byte
    plan = make_plan(source, manifest, Layout(tp=2, pp=2, fsdp=2))   # any layout: pp x fsdp x tp, experts on ep
    write_shards(source, plan, "out/")                # rank files + reshard.json, atomically
    model = empty_tp_model("out/")                    # a transformers TP model, no weights read
    fill_model(model, "out/")                         # this rank's shard into its parameters

`fill_model` and `empty_tp_model` need torch and transformers; they are imported on first use.
"""

from __future__ import annotations

from typing import Any

from reshard.errors import ReshardError
from reshard.io.sources import open_source
from reshard.io.writer import write_shards
from reshard.layout import Layout
from reshard.plan.planner import make_plan
from reshard.rules import quant as _quant  # noqa: F401  registers the quantized kinds (reshard/rules/quant/)

__version__ = "0.1.0"
__all__ = ["Layout", "ReshardError", "__version__", "empty_tp_model", "fill_model", "make_plan", "open_source", "write_shards"]


def __getattr__(name: str) -> Any:
    """`reshard.fill_model` / `reshard.empty_tp_model`, imported on first use (they need torch)."""
    if name in ("fill_model", "empty_tp_model"):
        from reshard import fill

        return getattr(fill, name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")

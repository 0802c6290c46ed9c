"""reshard: lazy per-rank tensor-parallel resharding of safetensors checkpoints."""

from __future__ import annotations

from typing import Any

from reshard import quant as _quant  # noqa: F401  registers the quantized kinds (reshard/quant/)
from reshard.errors import ReshardError

__version__ = "0.1.0"
__all__ = ["ReshardError", "__version__", "empty_tp_model", "fill_model"]


def __getattr__(name: str) -> Any:
    """`reshard.fill_model` / `reshard.empty_tp_model`, imported on first use (they need torch)."""
    if name == "fill_model":
        from reshard.fill import fill_model

        return fill_model
    if name == "empty_tp_model":
        from reshard.fill import empty_tp_model

        return empty_tp_model
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")

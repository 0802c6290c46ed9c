"""reshard: lazy per-rank tensor-parallel resharding of safetensors checkpoints."""

from reshard.errors import ReshardError

__version__ = "0.1.0"
__all__ = ["ReshardError", "__version__"]

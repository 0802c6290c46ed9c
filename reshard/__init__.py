"""reshard: lazy per-rank tensor-parallel resharding of safetensors checkpoints."""

from reshard import quant as _quant  # noqa: F401  registers the quantized kinds (reshard/quant/)
from reshard.errors import ReshardError

__version__ = "0.1.0"
__all__ = ["ReshardError", "__version__"]

"""Quantized checkpoints: FP8 weights shard together with their scales (see docs/manifest.md, "Adding a kind").

- `scheme`: config.json `quantization_config` -> the scale granularity, one function per `quant_method`.
- `kinds`: the quantized kinds (`column_fp8`, ...), one decorated factory each: a weight splits as its
  base kind, on block edges only; its scales take the blocks of its rows and columns.
- `rules`: the manifest hook: each rule's quantized twin, so a scale follows its weight's rule.
- `dequant`: the trainer's fill dequantizes FP8 weights into the training dtype, tensor by tensor.

Importing `reshard.rules` imports this package's kinds, so recorded kinds resolve everywhere.
"""

from reshard.rules.quant import awq, gptq, pack_quantized  # noqa: F401  (the int4 formats register themselves)
from reshard.rules.quant import fp8_kinds as kinds
from reshard.rules.quant.scheme import Scheme, register_quant_method, scheme_from_config

__all__ = ["Scheme", "kinds", "register_quant_method", "scheme_from_config"]

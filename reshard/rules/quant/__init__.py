"""Quantized checkpoints: weights shard together with their scales (see docs/quantization.md, docs/manifest.md).

- `scheme`: a packed format as a value (`QuantScheme`: its kinds, its tensors as `Part`s of `Axis`es)
  and config.json `quantization_config` -> the checkpoint's `Scheme`, one function per `quant_method`.
- `fp8_kinds`: FP8's kinds (`column_fp8`, ...): a weight splits as its base kind, on block edges only;
  its scales take the blocks of its rows and columns.
- `parts`: the kinds of a format described by its parts: every tensor of a quantized module split where
  the base kind splits the module's logical weight, in its own units (`mxfp4`, `nvfp4`, ...).
- one module per packed format (`mxfp4`, `nvfp4`, `gptq`, `awq`, `pack_quantized`; `int4` holds what the
  last three share): its scheme and its `quant_method`s, registered on import.
- `rules`: the manifest hook: each rule's quantized twin, so a scale follows its weight's rule.
- `dequant`: the trainer's fill dequantizes FP8 weights into the training dtype, tensor by tensor.

Importing `reshard.rules` imports this package's kinds, so recorded kinds resolve everywhere.
"""

from reshard.rules.quant import awq, gptq, mxfp4, nvfp4, pack_quantized  # noqa: F401  (their schemes and kinds register on import)
from reshard.rules.quant import fp8_kinds as kinds
from reshard.rules.quant.scheme import Scheme, register_quant_method, scheme_from_config

# rules an engine cut adds before the manifest's (`reshard.rules.engines`): how vLLM holds packed tensors
VLLM_RULES = (*mxfp4.ENGINE_RULES,)

__all__ = ["VLLM_RULES", "Scheme", "kinds", "register_quant_method", "scheme_from_config"]

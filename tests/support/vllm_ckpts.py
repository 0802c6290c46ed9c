"""Tiny HF checkpoints for the vLLM tests, made as a user would: transformers' `from_config` + `save_pretrained`
(random weights, the transformers installed beside vLLM), plus a word-level tokenizer, so that vLLM finds
config.json, the tokenizer and generation_config.json as in any downloaded model.

Sizes suit vLLM's CPU backend (its attention kernels take head_dim 32, not 16). The set covers what the
issue asks for: llama; qwen2 with qkv bias, tied embeddings and a vocabulary that 64 x tp does not divide;
two MoE architectures (Qwen2-MoE with its shared expert and qkv bias, Mixtral's w1/w2/w3 experts).

`from_config` initializes every bias to zero and every norm to one, so a bias or norm put in the wrong place
(another layer's, the k block's for the v block's) would load unnoticed; `make_model` draws them at random
too, from the same seed, so every tensor of a checkpoint is its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                        "max_position_embeddings": 256}
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "vocab_size": 1024, "tie_word_embeddings": False},
    # qkv bias; tied embeddings (no lm_head.weight on disk); 1000 is not a multiple of 64 x tp
    "qwen2": {"model_type": "qwen2", "vocab_size": 1000, "tie_word_embeddings": True},
    "qwen2_moe": {"model_type": "qwen2_moe", "vocab_size": 1000, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1,
                  "tie_word_embeddings": False},
    "mixtral": {"model_type": "mixtral", "vocab_size": 1024, "num_local_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": False},
}


def make_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` words `w0`..`wN` (prompts are given as token ids anyway)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(out)


def make_model(out: Path, name: str, *, seed: int = 0) -> Path:
    """Checkpoint `name` of MODELS in `out`: weights, config.json, generation_config.json, tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**BASE, **MODELS[name]}
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_constants(model, seed)
    model.save_pretrained(out)
    make_tokenizer(out, spec["vocab_size"])
    return out


def _randomize_constants(model: torch.nn.Module, seed: int) -> None:
    """Biases drawn from N(0, 0.5), norm weights from U(0.5, 1.5), in parameter order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name.rsplit(".", 2)[-2]:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


# llm-compressor's W8A8 scheme (int8 weights per channel, int8 activations per token): vLLM's CPU backend
# builds its layers (its FP8 schemes find no kernel there)
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}}}}


def quantized_model_dir(model_dir: Path, out: Path) -> Path:
    """A copy of a `model=` directory (no weights) whose config.json says the checkpoint is W8A8 quantized."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": W8A8}, indent=2))
    return out

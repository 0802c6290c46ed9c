"""Tiny HF checkpoints for the vLLM tests, made as a user would: transformers' `from_config` + `save_pretrained`
(random weights, the transformers installed beside vLLM), plus a word-level tokenizer, so that vLLM finds
config.json, the tokenizer and generation_config.json as in any downloaded model.

Sizes suit vLLM's CPU backend (its attention kernels take head_dim 32, not 16). The set covers what the
issue asks for: llama; qwen2 with qkv bias, tied embeddings and a vocabulary that 64 x tp does not divide;
two MoE architectures (Qwen2-MoE with its shared expert and qkv bias, Mixtral's w1/w2/w3 experts).
"""

from __future__ import annotations

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
    model.save_pretrained(out)
    make_tokenizer(out, spec["vocab_size"])
    return out


def meta_only(ckpt: Path, out: Path) -> Path:
    """A copy of the checkpoint's small files only (what `reshard pull --meta` gives a worker): no weights."""
    out.mkdir(parents=True, exist_ok=True)
    for p in ckpt.iterdir():
        if not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy2(p, out / p.name)
    return out

"""Tiny random checkpoints of many transformers architectures, and rules that shard them.

Each checkpoint is transformers' own `AutoModelForCausalLM.from_config` with random weights (std 0.1, so
logits are far from zero), saved with `save_pretrained`: on-disk names are transformers' (per-expert
MoE tensors included). A `reshard-rules.yaml` beside it says how to split them, so these tests do not
depend on which architectures have built-in plans; the trainer only ever reads the shard's own
self-description.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import yaml

from reshard.cli import main as reshard_cli

SMALL = {"vocab_size": 301, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "max_position_embeddings": 64}
MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True}

# name -> (model_type, config overrides); vocab 301 is divisible by neither 2 nor 4 (padded rows)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
    "mistral": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 24}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 8}),
    "gemma3_text": ("gemma3_text", {"head_dim": 16, "sliding_window": 8}),
    "phi3": ("phi3", {}),
    "phi3_hf_plan": ("phi3", {}),  # transformers' own Phi-3 plan: gathered qkv/gate_up, split row inputs
    "olmo": ("olmo", {"clip_qkv": 0.8}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0,
                            "attention_multiplier": 0.2}),
    "cohere": ("cohere", {}),
    "starcoder2": ("starcoder2", {}),
    "stablelm": ("stablelm", {}),
    "gpt_neox": ("gpt_neox", {}),
    "helium": ("helium", {"head_dim": 16}),
    "glm": ("glm", {"head_dim": 16}),
    "phi": ("phi", {}),
    "smollm3": ("smollm3", {}),
    "qwen3_moe": ("qwen3_moe", {**MOE, "head_dim": 16}),
    "mixtral": ("mixtral", dict(MOE)),
    "qwen2_moe": ("qwen2_moe", {**MOE, "shared_expert_intermediate_size": 48}),
    "olmoe": ("olmoe", dict(MOE)),
}
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")
IDS = torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(5))
IDS[0, :3] = torch.tensor([0, 300, 228])  # the first and last rows, and the last partition at tp=4


def hf_config(name: str) -> Any:
    import transformers

    model_type, extra = ARCHS[name]
    return transformers.AutoConfig.for_model(model_type, **{**SMALL, **extra})


def make_checkpoint(name: str, out: Path, *, seed: int = 1) -> Path:
    """`save_pretrained` of a random `from_config` model (fp32), plus its rules file."""
    import transformers

    config = hf_config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    chosen = HF_STYLE_RULES if name == "phi3_hf_plan" else rules(config)
    (out / "reshard-rules.yaml").write_text(yaml.safe_dump({"rules": chosen}, sort_keys=False))
    return out


# Phi3Config.base_model_tp_plan: colwise_gather_output (qkv_proj, gate_up_proj), rowwise_split_input
HF_STYLE_RULES = [
    {"regex": r".*\.(qkv_proj|gate_up_proj)\.weight", "kind": "column", "gather_output": True},
    {"regex": r".*\.(o_proj|down_proj)\.weight", "kind": "row", "split_input": True},
    {"regex": r".*embed_tokens\.weight", "kind": "vocab_embed", "pad": True},
    {"regex": r"lm_head\.weight", "kind": "column", "pad": True, "gather_output": True},
]


def rules(config: Any) -> list[dict[str, Any]]:
    """Column/row/vocab rules by module name (heads on q/k/v; kv heads replicated when fewer than tp)."""
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = config.intermediate_size
    tensor = r"\.(weight|bias)"
    out = [
        {"regex": rf".*\.q_proj{tensor}", "kind": "column", "heads": heads},
        {"regex": rf".*\.(k_proj|v_proj){tensor}", "kind": "column", "heads": kv, "replicate_heads": True},
        {"regex": rf".*\.query_key_value{tensor}", "kind": "column", "heads": heads},  # GPT-NeoX: per head q|k|v
        {"regex": rf".*\.qkv_proj{tensor}", "kind": "packed_column", "blocks": [heads * hd, kv * hd, kv * hd],
         "heads": [heads, kv, kv], "replicate_heads": [False, True, True]},
        {"regex": rf".*\.gate_up_proj{tensor}", "kind": "packed_column", "blocks": [inter, inter]},
        {"regex": rf".*\.(o_proj|self_attn\.dense|attention\.dense|down_proj|c_proj|fc2|dense_4h_to_h|w2){tensor}",
         "kind": "row"},
        {"regex": rf".*\.(gate_proj|up_proj|c_fc|fc1|dense_h_to_4h|w1|w3){tensor}", "kind": "column"},
        {"regex": r".*(embed_tokens|embed_in)\.weight", "kind": "vocab_embed", "pad": True},
        {"regex": rf"(lm_head|embed_out){tensor}", "kind": "column", "pad": True, "gather_output": True},
    ]
    return out


def pattern_kinds(config: Any, names: list[str]) -> dict[str, str]:
    """name -> kind under `rules` (first match), for asserting on what was split."""
    compiled = [(re.compile(r["regex"]), r["kind"]) for r in rules(config)]
    return {n: next((k for rx, k in compiled if rx.fullmatch(n)), "replicate") for n in names}


TP4 = ("llama", "phi3", "qwen3", "mixtral", "olmo2")  # kv heads 2 < tp 4: replicated kv heads (dense, packed, MoE)
GRADS = ("llama", "phi3", "qwen3", "gpt_neox", "olmo2")  # gradients compared element by element


def write_shards(src: Path, tp: int, out: Path) -> Path:
    assert reshard_cli(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 0
    return out


def reference_model(full: Path) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32).eval()

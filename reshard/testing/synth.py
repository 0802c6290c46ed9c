"""Small HF-format checkpoints with random weights, for tests, the demo and the benchmarks.

    config = llama_config(model_type="qwen2", hidden_size=64, num_hidden_layers=2)
    make_checkpoint(tmp_path / "ckpt", config, dtype=torch.bfloat16, num_files=3)

`state_dict_shapes` names every tensor exactly as the HF `*ForCausalLM` state dict does (the tests
check this against `transformers` for every supported model type). `make_checkpoint` writes
`config.json` plus `model.safetensors`, or `model-0000K-of-0000N.safetensors` files and
`model.safetensors.index.json`, as `save_pretrained` would. Each tensor is drawn from its own
generator seeded by (seed, name), so the values do not depend on dtype order or on `num_files`, and
the same arguments give the same bytes on every run. Only one output file's tensors are in memory
at a time; pass a larger `num_files` for a larger checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from reshard.errors import CheckpointError

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}

_CHUNK_ELEMENTS = 1 << 22  # rows are generated in chunks of about this many elements


def llama_config(
    *,
    model_type: str = "llama",
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 2048,
    **extra: Any,
) -> dict[str, Any]:
    """Return an HF `config.json` dict for a small Llama-family model.

    `model_type` is one of llama, mistral, qwen2 (always has q/k/v bias), qwen3 (q_norm/k_norm),
    gemma (scaled embeddings, 1+w norms, gelu_pytorch_tanh) or phi3 (fused qkv_proj/gate_up_proj).
    `attention_bias` applies to llama, qwen3 and gemma (q/k/v/o bias). `extra` keys are added
    last and override anything above.
    """
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported by reshard.testing.synth; use one of {sorted(ARCHITECTURES)}"
        )
    head_dim = _head_dim(hidden_size, num_attention_heads, num_key_value_heads, head_dim)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    }
    config.update(_architecture_keys(model_type, attention_bias=attention_bias,
                                     max_position_embeddings=max_position_embeddings))
    config.update(extra)
    return config


def _head_dim(hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int | None) -> int:
    """`head_dim`, derived when not given; head counts that no model could have are refused."""
    if head_dim is None:
        if hidden_size % num_attention_heads:
            raise CheckpointError(
                f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}; "
                "pass head_dim explicitly"
            )
        head_dim = hidden_size // num_attention_heads
    if num_attention_heads % num_key_value_heads:
        raise CheckpointError(
            f"num_attention_heads={num_attention_heads} is not a multiple of "
            f"num_key_value_heads={num_key_value_heads}"
        )
    return head_dim


def _architecture_keys(model_type: str, *, attention_bias: bool, max_position_embeddings: int) -> dict[str, Any]:
    """The config.json keys one architecture of `llama_config` adds or changes."""
    config: dict[str, Any] = {}
    if model_type in ("llama", "qwen3", "gemma"):
        config["attention_bias"] = attention_bias
    if model_type == "llama":
        config["mlp_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type == "gemma":
        config["hidden_act"] = "gelu_pytorch_tanh"
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["pad_token_id"] = 0
    if model_type == "phi3":
        config["original_max_position_embeddings"] = max_position_embeddings
        config["sliding_window"] = None
        config["resid_pdrop"] = 0.0
        config["embd_pdrop"] = 0.0
    return config


def bias_flags(config: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, mlp bias) as the HF class for `config["model_type"]` builds them."""
    model_type = config.get("model_type")
    if model_type == "qwen2":
        return True, False, False
    if model_type in ("llama", "qwen3", "gemma"):
        bias = bool(config.get("attention_bias", False))
        mlp = bool(config.get("mlp_bias", False)) if model_type == "llama" else False
        return bias, bias, mlp
    return False, False, False


def state_dict_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of `config`'s `*ForCausalLM`, in state-dict order."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported; use one of {sorted(ARCHITECTURES)}"
        )
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nh)
    hd = int(config.get("head_dim") or hidden // nh)
    vocab = int(config["vocab_size"])
    qkv_bias, o_bias, mlp_bias = bias_flags(config)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        attn: dict[str, tuple[int, ...]] = {}
        if model_type == "phi3":
            attn[p + "self_attn.o_proj.weight"] = (hidden, nh * hd)
            attn[p + "self_attn.qkv_proj.weight"] = ((nh + 2 * nkv) * hd, hidden)
        else:
            for proj, out in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                attn[p + f"self_attn.{proj}_proj.weight"] = (out, hidden)
                if qkv_bias:
                    attn[p + f"self_attn.{proj}_proj.bias"] = (out,)
            attn[p + "self_attn.o_proj.weight"] = (hidden, nh * hd)
            if o_bias:
                attn[p + "self_attn.o_proj.bias"] = (hidden,)
        if model_type == "qwen3":
            attn[p + "self_attn.q_norm.weight"] = (hd,)
            attn[p + "self_attn.k_norm.weight"] = (hd,)
        if model_type == "phi3":
            mlp = {
                p + "mlp.gate_up_proj.weight": (2 * inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        else:
            mlp = {}
            for proj, shape in (
                ("gate", (inter, hidden)),
                ("up", (inter, hidden)),
                ("down", (hidden, inter)),
            ):
                mlp[p + f"mlp.{proj}_proj.weight"] = shape
                if mlp_bias:
                    mlp[p + f"mlp.{proj}_proj.bias"] = (shape[0],)
        shapes.update(attn)
        shapes.update(mlp)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def random_tensor(
    name: str, shape: tuple[int, ...], *, model_type: str, dtype: torch.dtype, seed: int, std: float
) -> torch.Tensor:
    """One deterministic tensor: N(0, std) weights and biases; norm weights near 1.0.

    Gemma stores norm weights as an offset from 1 (its RMSNorm multiplies by 1 + w), so there they
    are drawn near 0.0 and the effective scale is still near 1.0.
    """
    gen = _generator(seed, name)
    is_norm = name.endswith("norm.weight")
    offset = 1.0 if is_norm and model_type != "gemma" else 0.0
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1) if out.dim() else out.view(1)
    step = _CHUNK_ELEMENTS
    for start in range(0, flat.numel(), step):
        chunk = torch.randn(min(step, flat.numel() - start), generator=gen, dtype=torch.float32)
        flat[start : start + chunk.numel()] = chunk.mul_(std).add_(offset).to(dtype)
    return out


def split_into_files(sizes: list[int], num_files: int) -> list[int]:
    """File index (0-based) for each tensor: contiguous, non-empty groups balanced by cumulative size."""
    if num_files < 1:
        raise CheckpointError(f"num_files={num_files}; it must be at least 1")
    if num_files > len(sizes):
        raise CheckpointError(f"num_files={num_files} exceeds the number of tensors ({len(sizes)}); lower it")
    total = sum(sizes)
    starts: list[int] = [0]  # first tensor index of every file
    cumulative = 0
    index = 0
    for k in range(1, num_files):
        target = total * k / num_files
        while index < len(sizes) and cumulative + sizes[index] / 2 <= target:
            cumulative += sizes[index]
            index += 1
        boundary = min(max(index, starts[-1] + 1), len(sizes) - (num_files - k))
        while index < boundary:
            cumulative += sizes[index]
            index += 1
        while index > boundary:
            index -= 1
            cumulative -= sizes[index]
        starts.append(boundary)
    assignment: list[int] = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(sizes)
        assignment.extend([k] * (end - start))
    return assignment


def make_checkpoint(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    *,
    dtype: torch.dtype = torch.float32,
    num_files: int = 1,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """Write a random-weight HF checkpoint for `config` into directory `path`; return the path.

    `config.json` gets `torch_dtype` set to `dtype`. With `num_files=1` the weights go to
    `model.safetensors`; otherwise to `model-0000K-of-0000N.safetensors` plus
    `model.safetensors.index.json`, the tensors split in state-dict order by cumulative size.
    """
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} is not supported; use one of {sorted(DTYPE_NAMES.values())}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shapes = state_dict_shapes(config)
    names = list(shapes)
    sizes = [math.prod(shapes[n]) * dtype.itemsize for n in names]
    assignment = split_into_files(sizes, num_files)
    if num_files == 1:
        file_names = ["model.safetensors"]
    else:
        file_names = [f"model-{k + 1:05d}-of-{num_files:05d}.safetensors" for k in range(num_files)]

    config_out = dict(config)
    config_out["torch_dtype"] = DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config_out, indent=2, sort_keys=True) + "\n")

    for stale in out.glob("model*.safetensors"):
        if stale.name not in file_names:
            stale.unlink()
    model_type = str(config["model_type"])
    for k, file_name in enumerate(file_names):
        tensors = {
            name: random_tensor(name, shapes[name], model_type=model_type, dtype=dtype, seed=seed, std=std)
            for name, a in zip(names, assignment, strict=True)
            if a == k
        }
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors

    index_path = out / "model.safetensors.index.json"
    if num_files > 1:
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": {name: file_names[a] for name, a in zip(names, assignment, strict=True)},
        }
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    elif index_path.exists():
        index_path.unlink()
    return out


# The demo's model: a few tens of millions of parameters, a vocabulary that tp=2 must pad
# (32001 rows), and config.json carrying its own HF-style tp_plan.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": dict(vocab_size=32001, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                 num_attention_heads=6, num_key_value_heads=2),
    "tiny": dict(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
HF_LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


def preset_config(name: str) -> dict[str, Any]:
    """A named llama config (`demo`, `tiny`) with `base_model_tp_plan` written into it."""
    if name not in PRESETS:
        raise CheckpointError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return llama_config(**PRESETS[name], base_model_tp_plan=HF_LLAMA_TP_PLAN)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m reshard.testing.synth", description="Write a random-weight HF checkpoint.")
    p.add_argument("out", help="output checkpoint directory")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--files", type=int, default=2, help="number of safetensors files (index.json when > 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_checkpoint(args.out, preset_config(args.preset), dtype=getattr(torch, args.dtype),
                    num_files=args.files, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

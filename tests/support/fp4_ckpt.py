"""4-bit float checkpoints for the tests, quantized from random weights by code written from the formats'
descriptions (OCP Microscaling Formats v1.0 for MXFP4; NVIDIA's NVFP4 as ModelOpt and compressed-tensors
export it), and their dequantizers (independent of reshard's code).

FP4 E2M1: 1 sign bit, 2 exponent bits, 1 mantissa bit; codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
codes 8..15 their negatives. Two codes per byte, the first (even index) in the low nibble.
- MXFP4: blocks of 32 values along K share one E8M0 scale byte s (value 2^(s-127)); stored
  `X_blocks` uint8 [..., N, K/32, 16], `X_scales` uint8 [..., N, K/32].
- NVFP4: groups of 16 values along K share one F8_E4M3 scale, times one F32 global scale per tensor:
  ModelOpt stores `weight_scale_2` (w = q * scale * scale_2), compressed-tensors `weight_global_scale`
  = 1 / scale_2 (w = q * scale / global).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_MAX, FP8_MAX = 6.0, 448.0
MX_BLOCK, NV_GROUP = 32, 16


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 code (0..15) of each value (already scaled into [-6, 6])."""
    mag = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    return (mag | ((x < 0).to(torch.long) << 3)).to(torch.uint8)


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> float32 values."""
    c = codes.to(torch.long)
    return E2M1[c & 7] * (1 - 2 * ((c >> 3) & 1)).to(torch.float32)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, even index in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


# --- MXFP4 -----------------------------------------------------------------------------------------

def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32]): per block the
    smallest power of two that brings its largest magnitude within 6."""
    *lead, k = w.shape
    x = w.float().reshape(*lead, k // MX_BLOCK, MX_BLOCK)
    amax = x.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / FP4_MAX)).clamp(-127, 127)
    codes = fp4_codes(x / torch.exp2(exp).unsqueeze(-1))
    return pack(codes), (exp + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(blocks [..., N, G, 16], scales [..., N, G]) -> float32 [..., N, G*32]."""
    values = fp4_values(unpack(blocks))  # [..., N, G, 32]
    return (values * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)).flatten(-2)


GPT_OSS = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 256}
MXFP4_QC = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}


def gpt_oss_mxfp4(path: Path, *, seed: int = 0, **config: Any) -> Path:
    """A tiny gpt-oss (transformers' GptOssConfig, random weights in bf16) with its experts in MXFP4 as
    the released checkpoints store them: `experts.gate_up_proj_blocks` [E, 2*inter, hidden/32, 16] (the
    transformers parameter [E, hidden, 2*inter] transposed: rows interleave gate and up), `down_proj_blocks`
    [E, hidden, inter/32, 16], their `_scales`, and bf16 biases (random, so a wrong split shows)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**{**GPT_OSS, **config})
    torch.manual_seed(seed)
    state = {k: v.to(torch.bfloat16) for k, v in GptOssForCausalLM(cfg).state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(t.float().transpose(1, 2))
            out[name + "_blocks"], out[name + "_scales"] = blocks.contiguous(), scales.contiguous()
        elif name.endswith("_bias"):
            out[name] = (torch.randn(t.shape) * 0.1).to(torch.bfloat16)
        else:
            out[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    obj = json.loads(cfg.to_json_string())
    obj.update(quantization_config=MXFP4_QC, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(obj, indent=2))
    return path


# --- NVFP4 -----------------------------------------------------------------------------------------

def nvfp4_quantize(w: torch.Tensor, group: int = NV_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (packed uint8 [..., N, K/2], scale F8_E4M3 [..., N, K/group], scale_2 F32 scalar):
    scale_2 = amax(w) / (6 * 448), each group's scale = its amax / 6 / scale_2 in E4M3, q = w / (scale * scale_2)."""
    *lead, k = w.shape
    x = w.float().reshape(*lead, k // group, group)
    scale_2 = (w.float().abs().amax() / (FP4_MAX * FP8_MAX)).clamp(min=1e-12)
    scale = (x.abs().amax(-1) / FP4_MAX / scale_2).clamp(min=2.0**-9, max=FP8_MAX).to(torch.float8_e4m3fn)
    codes = fp4_codes(x / (scale.float() * scale_2).unsqueeze(-1))
    return pack(codes.reshape(*lead, k)), scale, scale_2.reshape(())


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     group: int = NV_GROUP) -> torch.Tensor:
    """(packed [..., N, K/2], scale [..., N, K/g], scale_2) -> float32 [..., N, K]: q * scale * scale_2."""
    values = fp4_values(unpack(packed))
    return values * (scale.float() * scale_2.float()).repeat_interleave(group, dim=-1)


NVFP4_LINEAR = r"(q|k|v|o|gate|up|down)_proj"


def nvfp4_checkpoint(path: Path, config: dict[str, Any], *, flavour: str = "modelopt", seed: int = 0,
                     keep: tuple[str, ...] = ()) -> Path:
    """A tiny checkpoint of `config` (reshard.testing.synth's builder, random weights) whose linear
    projections (`*_proj.weight`, but those in `keep`) are NVFP4: `flavour` "modelopt" (`X.weight`,
    `X.weight_scale`, `X.weight_scale_2`, `X.input_scale`) or "ct" (`X.weight_packed`, `X.weight_scale`,
    `X.weight_global_scale`, `X.input_global_scale`, `format: nvfp4-pack-quantized`)."""
    import re

    from reshard.testing.synth import make_checkpoint

    make_checkpoint(path, config, seed=seed, dtype=torch.bfloat16)
    from safetensors.torch import load_file

    full = load_file(str(path / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    torch.manual_seed(seed + 1)
    for name, t in full.items():
        stem = name.removesuffix(".weight")
        if not re.fullmatch(rf".*\.{NVFP4_LINEAR}\.weight", name) or name in keep:
            out[name] = t
            continue
        packed, scale, scale_2 = nvfp4_quantize(t)
        input_scale = torch.rand(()) + 0.5
        if flavour == "modelopt":
            out.update({name: packed, stem + ".weight_scale": scale, stem + ".weight_scale_2": scale_2,
                        stem + ".input_scale": input_scale})
        else:
            out.update({stem + ".weight_packed": packed, stem + ".weight_scale": scale,
                        stem + ".weight_global_scale": (1 / scale_2).reshape(1),
                        stem + ".input_global_scale": (1 / input_scale).reshape(1)})
    (path / "model.safetensors").unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = NVFP4_QC[flavour]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


NVFP4_QC: dict[str, dict[str, Any]] = {
    "modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                 "exclude_modules": ["lm_head"], "ignore": ["lm_head"]},  # (hf_quant_config.json's key, config.json's)
    "ct": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
               "dynamic": False}, "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                        "group_size": 16, "dynamic": "local"}}}},
}

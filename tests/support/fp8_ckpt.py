"""FP8 checkpoints made the way their producers make them, and the reference math to check shards with.

`quantize_block` is DeepSeek-V3's / Qwen3-FP8's recipe: per block of B0 x B1 (partial blocks at the
edges), scale = amax / 448 (the float8_e4m3fn maximum), weight = round-to-fp8(w / scale); the scale
is stored as `weight_scale_inv` (F32), and w ~ fp8 * scale_inv. compressed-tensors stores the same
per output channel (`weight_scale` [out, 1]) or per tensor (`weight_scale` [1]) plus `input_scale`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from reshard.cli import main
from reshard.testing.synth import llama_config, make_checkpoint

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
LINEAR = re.compile(r".*\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj\.weight")

BLOCK_QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def ct_qc(strategy: str, *, static_input: bool = False) -> dict[str, Any]:
    """A compressed-tensors `quantization_config` (llm-compressor's FP8 schemes)."""
    inputs = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": inputs if static_input else None,
        }},
    }


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, F32 scale_inv [ceil(out/B0), ceil(in/B1)])."""
    (out, inn), (b0, b1) = w.shape, block
    n0, n1 = -(-out // b0), -(-inn // b1)
    padded = torch.zeros(n0 * b0, n1 * b1)
    padded[:out, :inn] = w.float()
    blocks = padded.view(n0, b0, n1, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n0 * b0, n1 * b1)[:out, :inn].contiguous(), scale


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, BF16 scale [out, 1])."""
    scale = (w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX).to(torch.bfloat16)
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, F32 scale [1])."""
    scale = (w.float().abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(1)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequant_ref(q: torch.Tensor, scale: torch.Tensor, block: tuple[int | None, int | None]) -> torch.Tensor:
    """q * scale with each scale entry repeated over its block (None: the whole dim), cropped to q."""
    s = scale.float()
    if s.numel() == 1:  # per tensor
        return q.float() * s.reshape(())
    for d, b in enumerate(block):
        s = s.repeat_interleave(b, d) if b else s.expand(*[q.shape[d] if i == d else -1 for i in range(s.dim())])
        s = s.narrow(d, 0, q.shape[d])
    return q.float() * s


def fp8_checkpoint(path: Path, config: dict[str, Any], qc: dict[str, Any], *, seed: int = 0,
                   keep: tuple[str, ...] = ()) -> Path:
    """A random bf16 checkpoint for `config` (reshard.testing.synth), its linear weights quantized as `qc` says
    (but for the weights in `keep`, as `modules_to_not_convert` leaves them)."""
    make_checkpoint(path, config, dtype=torch.bfloat16, seed=seed, std=0.05)
    state = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not LINEAR.fullmatch(name) or name in keep:
            out[name] = w
            continue
        stem = name[: -len(".weight")]
        if qc["quant_method"] == "fp8":
            out[name], out[stem + ".weight_scale_inv"] = quantize_block(w, tuple(qc["weight_block_size"]))
            continue
        group = qc["config_groups"]["group_0"]
        quantize = quantize_channel if group["weights"]["strategy"] == "channel" else quantize_tensor
        out[name], out[stem + ".weight_scale"] = quantize(w)
        if group["input_activations"]:
            out[stem + ".input_scale"] = torch.rand(1, generator=gen) + 0.5
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def block_of(qc: dict[str, Any]) -> tuple[int | None, int | None]:
    if qc["quant_method"] == "fp8":
        return tuple(qc["weight_block_size"])
    return (1, None) if qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel" else (None, None)


def dequantized_state(path: Path, qc: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full checkpoint with every quantized weight dequantized (float32), scales dropped."""
    state = load_file(path / "model.safetensors")
    out = {}
    for name, t in state.items():
        stem = name[: -len(".weight")]
        scale = state.get(stem + ".weight_scale_inv", state.get(stem + ".weight_scale"))
        if name.endswith(".weight") and scale is not None:
            out[name] = dequant_ref(t, scale, block_of(qc))
        elif not name.endswith(("_scale", "_scale_inv")):
            out[name] = t.float()
    return out


# in=320 (hidden) is 2.5 blocks of 128: the column weights' partial ceil blocks; 8 heads of 128, 2 kv heads
_BASE = {"hidden_size": 320, "num_attention_heads": 8, "head_dim": 128, "num_key_value_heads": 2,
         "intermediate_size": 1024, "num_hidden_layers": 1, "vocab_size": 256}
# name -> (config, quantization_config); every tp in {1, 2, 4, 8} splits these on block edges
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "block": (llama_config(**_BASE), BLOCK_QC),
    "block_phi3": (llama_config(model_type="phi3", **_BASE), BLOCK_QC),  # fused qkv_proj / gate_up_proj
    # per-channel needs no block edges: an intermediate size of 1000 splits at tp=8 (125 rows each)
    "channel": (llama_config(**{**_BASE, "intermediate_size": 1000}), ct_qc("channel")),
    "tensor": (llama_config(**_BASE), ct_qc("tensor", static_input=True)),
}
TPS = (1, 2, 4, 8)


def write(src: Path, tp: int, out: Path, *extra: str) -> Path:
    assert main(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress", *extra]) == 0
    return out

"""A decoder-only Llama-family model in plain PyTorch, with HF module and parameter names.

Covers llama, mistral, qwen2 (q/k/v bias), qwen3 (per-head q/k RMSNorm), gemma (scaled embeddings,
1 + w norms, tanh-GELU) and phi3 (fused `qkv_proj` and `gate_up_proj`). An HF checkpoint loads with
`load_state_dict(strict=True)` and no renaming; logits match `transformers` in fp32.

This file knows nothing of parallelism. Tensor parallelism swaps modules afterwards, so nothing here
trusts a stored head count or width: attention takes its number of (local) query and key/value heads
from the projection outputs at forward time, the GQA ratio is local q heads // local kv heads, the
fused qkv output is split by the ratio nh : nkv : nkv of whatever width arrives (or by the
projection's own `out_split` widths when it has them: kv heads shared between ranks break the
ratio), and the MLP assumes no sizes. The model builds on the meta device without allocating (`LlamaForCausalLM(cfg,
device="meta")` or under `with torch.device("meta"):`), then `to_empty(device=...)`, then load or
`init_weights()`. Rotary frequencies are recomputed from the config, never stored in a buffer, so
`to_empty` garbage cannot reach them.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reshard.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers the model needs; build it from a config.json dict with `from_hf`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (always on for qwen2)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k
    fused_projections: bool = False  # phi3: qkv_proj and gate_up_proj
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    hidden_act: str = "silu"
    sliding_window: int | None = None
    initializer_range: float = 0.02

    @property
    def gemma(self) -> bool:
        return self.model_type == "gemma"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Read an HF `config.json` dict; raise CheckpointError for anything not implemented here."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"config.json: model_type {model_type!r} is not supported by reshard.trainer; "
                f"use one of {list(SUPPORTED_MODEL_TYPES)}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in config:
                raise CheckpointError(f"config.json: missing {key!r} for model_type {model_type!r}")
        rope_theta, rope_type, partial = _rope_settings(config)
        if rope_type not in ("default", None):
            raise CheckpointError(
                f"config.json: rope_scaling / rope_parameters type {rope_type!r} is not implemented; "
                "only plain RoPE (rope_scaling: null) is supported"
            )
        if partial != 1.0:
            raise CheckpointError(
                f"config.json: partial_rotary_factor={partial} is not implemented; only 1.0"
            )
        hidden, nh = int(config["hidden_size"]), int(config["num_attention_heads"])
        nkv = int(config.get("num_key_value_heads") or nh)
        if nh % nkv:
            raise CheckpointError(
                f"config.json: num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}"
            )
        act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
        if model_type == "gemma" and act == "gelu":
            act = "gelu_pytorch_tanh"  # what HF Gemma runs for the legacy "gelu" setting
        if act not in _ACTIVATIONS:
            raise CheckpointError(
                f"config.json: activation {act!r} is not implemented; use {list(_ACTIVATIONS)}"
            )
        if config.get("mlp_bias") and model_type != "llama":
            raise CheckpointError(f"config.json: mlp_bias is only supported for llama, not {model_type!r}")
        window = config.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
            window = None
        bias = model_type == "qwen2" or (
            model_type in ("llama", "qwen3", "gemma") and bool(config.get("attention_bias"))
        )
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=nh,
            num_key_value_heads=nkv,
            head_dim=int(config.get("head_dim") or hidden // nh),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type == "gemma")),
            attention_bias=bias,
            o_proj_bias=bias and model_type != "qwen2",
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            fused_projections=model_type == "phi3",
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            model_type=model_type,
            hidden_act=act,
            sliding_window=int(window) if window else None,
            initializer_range=float(config.get("initializer_range", 0.02)),
        )


def _rope_settings(config: dict[str, Any]) -> tuple[float, str | None, float]:
    """(theta, rope type, partial rotary factor) from v4-style keys or a v5 `rope_parameters` dict."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type")) if scaling else params.get("rope_type")
    partial = float(config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    return theta, rope_type, partial


class RMSNorm(nn.Module):
    """HF Llama RMSNorm (`weight * normed.to(dtype)`), or Gemma's (`(normed * (1 + weight)).to(dtype)`)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.offset else nn.init.ones_(self.weight)


class RotaryEmbedding(nn.Module):
    """cos/sin exactly as HF's default RoPE: inv_freq on CPU in fp32, angles in fp32, then cast.

    Holds no buffers: inv_freq is recomputed from (theta, head_dim) and cached per device in a plain
    attribute, so meta construction and `to_empty` never touch it.
    """

    def __init__(self, *, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
            self._inv_freq[device] = (1.0 / (self.theta**exponent)).to(device)
        return self._inv_freq[device]

    def forward(self, position_ids: torch.Tensor, *, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, head_dim]; cos, sin: [b, s, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d], each kv head repeated n_rep times in place."""
    if n_rep == 1:
        return x
    b, nkv, s, d = x.shape
    return x[:, :, None].expand(b, nkv, n_rep, s, d).reshape(b, nkv * n_rep, s, d)


class Attention(nn.Module):
    """Causal grouped-query attention; head counts come from the projection widths at forward time."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, hd = config.hidden_size, config.head_dim
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = hd
        self.qkv_ratio = (nh, nkv)  # a ratio only: splits a fused qkv output of any width
        self.sliding_window = config.sliding_window
        if config.fused_projections:  # HF Phi3 registers o_proj first
            self.o_proj = nn.Linear(nh * hd, hidden, bias=config.o_proj_bias)
            self.qkv_proj = nn.Linear(hidden, (nh + 2 * nkv) * hd, bias=config.attention_bias)
        else:
            self.q_proj = nn.Linear(hidden, nh * hd, bias=config.attention_bias)
            self.k_proj = nn.Linear(hidden, nkv * hd, bias=config.attention_bias)
            self.v_proj = nn.Linear(hidden, nkv * hd, bias=config.attention_bias)
            self.o_proj = nn.Linear(nh * hd, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not hasattr(self, "qkv_proj"):
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = self.qkv_proj(x)
        split = getattr(self.qkv_proj, "out_split", None)  # a fused layer that knows its block widths
        if split is not None:
            q, k, v = qkv.split(split, dim=-1)
            return q, k, v
        nh, nkv = self.qkv_ratio
        width = qkv.shape[-1]
        if width % (nh + 2 * nkv):
            raise ValueError(f"fused qkv width {width} is not divisible by nh + 2*nkv = {nh + 2 * nkv}")
        unit = width // (nh + 2 * nkv)
        q, k, v = qkv.split([unit * nh, unit * nkv, unit * nkv], dim=-1)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.sliding_window is not None and s > self.sliding_window:
            raise ValueError(
                f"sequence length {s} exceeds sliding_window={self.sliding_window}; not implemented"
            )
        q, k, v = self._project(x)
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = v.view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); phi3 computes gate and up as the two halves of gate_up_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.act = _ACTIVATIONS[config.hidden_act]
        if config.fused_projections:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=config.gemma)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, offset=config.gemma
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """`model.*` of the HF causal LM: embed_tokens, layers, norm (and a stateless rotary_emb)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        shape = (config.vocab_size, config.hidden_size)
        # On meta, skip nn.Embedding's own normal_ init: it imports torch._dynamo (seconds per rank).
        meta = torch.empty(shape, device="meta") if torch.empty(0).is_meta else None
        self.embed_tokens = nn.Embedding(*shape, _weight=meta)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=config.gemma)
        self.rotary_emb = RotaryEmbedding(head_dim=config.head_dim, theta=config.rope_theta)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.config.gemma:
            h = h * torch.tensor(self.config.hidden_size**0.5, device=h.device).to(h.dtype)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = self.rotary_emb(position_ids, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """HF-named causal LM: `model.embed_tokens`, `model.layers[i].{self_attn,mlp,...}`, `model.norm`,
    `lm_head`.

    With tied embeddings `lm_head.weight` is `model.embed_tokens.weight`; `state_dict()` leaves the
    `lm_head.weight` key out (as HF safetensors checkpoints do) and `load_state_dict` accepts a dict
    without it. Moving the model (`to`, `to_empty`, ...) re-ties automatically.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device(device) if device is not None else nullcontext():
            self.model = LlamaModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_state_dict_post_hook(_drop_tied_head)
        self.register_load_state_dict_pre_hook(_fill_tied_head)
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the very Parameter `model.embed_tokens.weight` when the config ties."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn: Any, recurse: bool = True) -> LlamaForCausalLM:
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random init like HF: N(0, initializer_range) for linears and embeddings, zero biases, unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def hidden_states(
        self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[b, s] token ids -> [b, s, hidden] after the final norm (for a trainer with its own head)."""
        return self.model(input_ids, position_ids)

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s] token ids -> [b, s, vocab] logits."""
        return self.lm_head(self.model(input_ids, position_ids))


def _drop_tied_head(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    if module.config.tie_word_embeddings:
        state_dict.pop(prefix + "lm_head.weight", None)


def _fill_tied_head(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    key, source = prefix + "lm_head.weight", prefix + "model.embed_tokens.weight"
    if module.config.tie_word_embeddings and key not in state_dict and source in state_dict:
        state_dict[key] = state_dict[source]


"""reshard.trainer.model against transformers' own models, meta construction and head-count freedom."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from reshard.errors import CheckpointError
from reshard.synth import llama_config, make_checkpoint, state_dict_shapes
from reshard.trainer.model import Attention, LlamaForCausalLM, ModelConfig

transformers = pytest.importorskip("transformers")

CASES = {
    "llama_gqa": llama_config(num_attention_heads=4, num_key_value_heads=2),
    "llama_bias": llama_config(attention_bias=True, num_key_value_heads=4),
    "mistral": llama_config(model_type="mistral", num_key_value_heads=1),
    "qwen2_bias": llama_config(model_type="qwen2", rope_theta=1e6),
    "qwen3_qk_norm": llama_config(model_type="qwen3", head_dim=24),
    "tied": llama_config(tie_word_embeddings=True),
    "gemma": llama_config(model_type="gemma", head_dim=32, num_key_value_heads=1),
    "phi3_fused": llama_config(model_type="phi3", num_key_value_heads=2, rms_norm_eps=1e-5),
}


def _checkpoint(tmp_path: Path, config: dict) -> dict[str, torch.Tensor]:
    out = make_checkpoint(tmp_path / "ckpt", config, std=0.1, seed=1)
    return load_file(out / "model.safetensors")


def _hf_model(config: dict, state: dict[str, torch.Tensor]) -> nn.Module:
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights() if config["tie_word_embeddings"] else None
    return model.eval()


def _ids(config: dict, *, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    config = CASES[case]
    state = _checkpoint(tmp_path, config)
    ours = LlamaForCausalLM(ModelConfig.from_hf(config))
    ours.load_state_dict(state, strict=True)
    ours.eval()
    hf = _hf_model(config, state)
    ids = _ids(config)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
        hidden = ours.hidden_states(ids)
        hf_hidden = hf.model(input_ids=ids).last_hidden_state
    assert got.shape == (2, 12, config["vocab_size"])
    assert expected.abs().max() > 0.1  # the comparison is not trivially small
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden, hf_hidden, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["llama_gqa", "gemma", "qwen3_qk_norm"])
def test_bf16_matches_transformers_sdpa(tmp_path: Path, case: str) -> None:
    config = CASES[case]
    state = load_file(make_checkpoint(tmp_path, config, dtype=torch.bfloat16, std=0.1) / "model.safetensors")
    ours = LlamaForCausalLM(ModelConfig.from_hf(config)).to(torch.bfloat16)
    ours.load_state_dict(state, strict=True)
    hf_config = transformers.AutoConfig.for_model(**config)
    hf = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="sdpa", dtype=torch.bfloat16
    )
    hf.load_state_dict(state, strict=True)
    ids = _ids(config)
    with torch.no_grad():
        got, expected = ours(ids), hf(input_ids=ids).logits
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)  # bit-equal with transformers 5.x


@pytest.mark.parametrize("case", ["qwen3_qk_norm", "tied", "phi3_fused"])
def test_state_dict_names_are_hf_names(case: str) -> None:
    config = CASES[case]
    model = LlamaForCausalLM(ModelConfig.from_hf(config))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert list(shapes.items()) == list(state_dict_shapes(config).items())


@pytest.mark.parametrize("case", ["llama_gqa", "tied", "phi3_fused"])
def test_meta_construction_then_load(tmp_path: Path, case: str) -> None:
    config = CASES[case]
    state = _checkpoint(tmp_path, config)
    reference = LlamaForCausalLM(ModelConfig.from_hf(config))
    reference.load_state_dict(state, strict=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf(config))
    assert all(p.is_meta for p in model.parameters())
    assert not list(model.buffers())
    model.to_empty(device="cpu")
    if config["tie_word_embeddings"]:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.load_state_dict(state, strict=True)
    ids = _ids(config)
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    by_arg = LlamaForCausalLM(ModelConfig.from_hf(config), device="meta")
    assert all(p.is_meta for p in by_arg.parameters())


def test_init_weights() -> None:
    model = LlamaForCausalLM(ModelConfig.from_hf(llama_config(hidden_size=128, intermediate_size=256)))
    up = model.model.layers[0].mlp.up_proj.weight
    assert abs(up.std().item() - 0.02) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones(128))
    gemma_config = llama_config(model_type="gemma")
    del gemma_config["tie_word_embeddings"]
    gemma = LlamaForCausalLM(ModelConfig.from_hf(gemma_config))
    assert torch.equal(gemma.model.norm.weight, torch.zeros(64))
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight  # gemma ties by default


def _shard_linear(linear: nn.Linear, *, dim: int, blocks: list[int], tp: int, rank: int) -> nn.Linear:
    """The rank's slice of `linear`, each block along `dim` split on its own (column/packed or row)."""
    weight_parts, bias_parts, start = [], [], 0
    for size in blocks:
        piece = size // tp
        lo = start + rank * piece
        weight_parts.append(linear.weight.narrow(dim, lo, piece))
        if linear.bias is not None and dim == 0:
            bias_parts.append(linear.bias[lo : lo + piece])
        start += size
    weight = torch.cat(weight_parts, dim=dim)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bool(bias_parts))
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias_parts:
            out.bias.copy_(torch.cat(bias_parts))
    return out


@pytest.mark.parametrize("case", ["llama_gqa", "qwen2_bias", "qwen3_qk_norm", "phi3_fused"])
@pytest.mark.parametrize("tp", [2])
def test_attention_and_mlp_take_local_heads_from_widths(tmp_path: Path, case: str, tp: int) -> None:
    """Swapping in per-rank slices (fewer heads, narrower MLP) and summing the row outputs gives the
    full result: nothing in the forward depends on the stored head counts or sizes."""
    config = CASES[case]
    model = LlamaForCausalLM(ModelConfig.from_hf(config))
    model.load_state_dict(_checkpoint(tmp_path, config), strict=True)
    layer = model.model.layers[0]
    x = torch.randn(2, 10, config["hidden_size"], generator=torch.Generator().manual_seed(2))
    cos, sin = model.model.rotary_emb(torch.arange(10)[None], dtype=x.dtype)
    hd, nh, nkv = model.config.head_dim, model.config.num_attention_heads, model.config.num_key_value_heads
    with torch.no_grad():
        full_attn, full_mlp = layer.self_attn(x, cos, sin), layer.mlp(x)
        attn_sum, mlp_sum = torch.zeros_like(x), torch.zeros_like(x)
        for rank in range(tp):
            attn: Attention = copy.deepcopy(layer.self_attn)
            mlp = copy.deepcopy(layer.mlp)
            if hasattr(attn, "qkv_proj"):
                blocks = [nh * hd, nkv * hd, nkv * hd]
                attn.qkv_proj = _shard_linear(attn.qkv_proj, dim=0, blocks=blocks, tp=tp, rank=rank)
                inter = model.config.intermediate_size
                mlp.gate_up_proj = _shard_linear(
                    mlp.gate_up_proj, dim=0, blocks=[inter, inter], tp=tp, rank=rank
                )
            else:
                for name, size in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
                    sharded = _shard_linear(getattr(attn, name), dim=0, blocks=[size], tp=tp, rank=rank)
                    setattr(attn, name, sharded)
                for name in ("gate_proj", "up_proj"):
                    size = model.config.intermediate_size
                    setattr(
                        mlp, name, _shard_linear(getattr(mlp, name), dim=0, blocks=[size], tp=tp, rank=rank)
                    )
            attn.o_proj = _shard_linear(attn.o_proj, dim=1, blocks=[nh * hd], tp=tp, rank=rank)
            mlp.down_proj = _shard_linear(
                mlp.down_proj, dim=1, blocks=[model.config.intermediate_size], tp=tp, rank=rank
            )
            attn_sum += attn(x, cos, sin)
            mlp_sum += mlp(x)
        if layer.self_attn.o_proj.bias is not None:
            attn_sum += layer.self_attn.o_proj.bias
    torch.testing.assert_close(attn_sum, full_attn, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mlp_sum, full_mlp, atol=1e-5, rtol=1e-5)


def test_rejects_what_it_does_not_implement() -> None:
    with pytest.raises(CheckpointError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**llama_config(), "model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="llama3"):
        ModelConfig.from_hf({**llama_config(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(CheckpointError, match="yarn"):
        ModelConfig.from_hf({**llama_config(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        ModelConfig.from_hf({**llama_config(model_type="phi3"), "partial_rotary_factor": 0.5})
    v5 = {k: v for k, v in llama_config().items() if k not in ("rope_theta", "rope_scaling")}
    cfg = ModelConfig.from_hf({**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert cfg.rope_theta == 5e5  # transformers v5 style rope parameters

"""reshard.testing.synth: HF names and shapes, file layout, determinism, loadability."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reshard.errors import CheckpointError
from reshard.testing.synth import llama_config, make_checkpoint, split_into_files, state_dict_shapes

pytestmark = pytest.mark.pure

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"]


def _hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)  # safetensors checkpoints drop the tied copy
    return shapes


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("tie", [False, True])
def test_names_and_shapes_match_transformers(model_type: str, tie: bool) -> None:
    config = llama_config(
        model_type=model_type,
        tie_word_embeddings=tie,
        attention_bias=tie and model_type == "llama",
        head_dim=24 if model_type == "qwen3" else None,
        num_attention_heads=4,
        num_key_value_heads=1 if model_type == "phi3" else 2,
    )
    ours = state_dict_shapes(config)
    hf = _hf_shapes(config)
    assert list(ours.items()) == list(hf.items())


def test_bias_names() -> None:
    qwen2 = state_dict_shapes(llama_config(model_type="qwen2", hidden_size=32, num_attention_heads=4))
    assert qwen2["model.layers.0.self_attn.k_proj.bias"] == (16,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    llama = state_dict_shapes(llama_config(attention_bias=True))
    assert "model.layers.1.self_attn.o_proj.bias" in llama


def test_config_fields() -> None:
    config = llama_config(model_type="qwen3", head_dim=32, rope_theta=5e5, extra_key=7)
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 32 and config["rope_theta"] == 5e5 and config["extra_key"] == 7
    with pytest.raises(CheckpointError, match="model_type"):
        llama_config(model_type="gpt2")


def test_split_into_files() -> None:
    assert split_into_files([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert split_into_files([100, 1, 1, 1], 3) == [0, 1, 2, 2]
    assert split_into_files([1, 1, 1, 100], 4) == [0, 1, 2, 3]
    assert split_into_files([5], 1) == [0]
    with pytest.raises(CheckpointError, match="num_files"):
        split_into_files([1, 2], 3)


def _files_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_single_file_checkpoint(tmp_path: Path) -> None:
    config = llama_config(model_type="qwen2")
    out = make_checkpoint(tmp_path / "a", config, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written["model_type"] == "qwen2"
    tensors = load_file(out / "model.safetensors")
    shapes = state_dict_shapes(config)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    norm = tensors["model.layers.0.input_layernorm.weight"].float()
    assert abs(norm.mean().item() - 1.0) < 0.05
    weight = tensors["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(weight.std().item() - 0.02) < 0.005
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharded_checkpoint_index(tmp_path: Path) -> None:
    config = llama_config(num_hidden_layers=3)
    out = make_checkpoint(tmp_path / "s", config, dtype=torch.float16, num_files=3)
    names = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json", *names]
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shapes = state_dict_shapes(config)
    assert set(index["weight_map"]) == set(shapes)
    assert set(index["weight_map"].values()) == set(names)
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    assert index["metadata"] == {"total_size": total}
    # files hold contiguous runs of the state-dict order and agree with the weight map
    order = [names.index(index["weight_map"][n]) for n in shapes]
    assert order == sorted(order)
    for name in names:
        tensors = load_file(out / name)
        assert set(tensors) == {n for n, f in index["weight_map"].items() if f == name}
    # same values as an unsharded checkpoint: each tensor depends only on (seed, name)
    single = load_file(make_checkpoint(tmp_path / "one", config, dtype=torch.float16) / "model.safetensors")
    merged: dict[str, torch.Tensor] = {}
    for name in names:
        merged.update(load_file(out / name))
    assert merged.keys() == single.keys()
    assert all(torch.equal(merged[k], single[k]) for k in single)


def test_rewrite_removes_stale_files(tmp_path: Path) -> None:
    config = llama_config()
    make_checkpoint(tmp_path, config, num_files=2)
    make_checkpoint(tmp_path, config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_bytes(tmp_path: Path, dtype: torch.dtype) -> None:
    config = llama_config(model_type="phi3", num_key_value_heads=4)
    a = make_checkpoint(tmp_path / "a", config, dtype=dtype, num_files=2, seed=3)
    b = make_checkpoint(tmp_path / "b", config, dtype=dtype, num_files=2, seed=3)
    c = make_checkpoint(tmp_path / "c", config, dtype=dtype, num_files=2, seed=4)
    assert _files_bytes(a) == _files_bytes(b)
    assert _files_bytes(a) != _files_bytes(c)


def test_bad_dtype(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="dtype"):
        make_checkpoint(tmp_path, llama_config(), dtype=torch.int8)

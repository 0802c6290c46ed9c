"""`model_shapes(config, names)`: the shape transformers' model of a config.json gives each name on disk,
renamed (Mixtral's `block_sparse_moe.gate`) and fused (one expert's block of Qwen3-MoE's `gate_up_proj`)
names included; the reference is the model transformers builds itself, on CPU. The shapes are kept in
the user's cache: a damaged record is a miss, a valid one is what later calls get."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from reshard.rules.tp_plans.built import model_shapes

pytestmark = pytest.mark.pure

MOE = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
           num_experts_per_tok=2)
MIXTRAL = dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)


def _own(config: dict) -> dict[str, tuple[int, ...]]:
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def test_names_on_disk_get_the_models_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    own = _own(MOE)
    gate_up = own["model.layers.0.mlp.experts.gate_up_proj"]  # [E, gate+up, H]
    names = ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
             "model.layers.0.mlp.experts.1.down_proj.weight", "model.layers.0.self_attn.k_proj.weight", "not.a.tensor"]
    got = model_shapes(MOE, names)
    assert got == {names[0]: (gate_up[1] // 2, gate_up[2]), names[1]: (gate_up[1] // 2, gate_up[2]),
                   names[2]: own["model.layers.0.mlp.experts.down_proj"][1:], names[3]: own[names[3]]}
    mixtral = _own(MIXTRAL)
    gate = "model.layers.1.block_sparse_moe.gate.weight"
    assert model_shapes(MIXTRAL, [gate]) == {gate: mixtral["model.layers.1.mlp.gate.weight"]}
    assert model_shapes({**MOE, "quantization_config": {"quant_method": "fp8"}}, names) == {}  # packed: not judged
    assert model_shapes({"model_type": "no-such-model"}, names) == {}


def test_the_cache_is_read_and_a_damaged_record_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    name = "model.layers.0.self_attn.q_proj.weight"
    want = {name: _own(MOE)[name]}
    assert model_shapes(MOE, [name]) == want
    [record] = (tmp_path / "reshard" / "model-shapes").iterdir()
    for damaged in ("{", '{"x": "y"}', "[1, 2]", ""):
        record.write_text(damaged)
        assert model_shapes(MOE, [name]) == want
    record.write_text(json.dumps({name: [7, 7]}))  # a valid record is taken as it is: no model built
    assert model_shapes(MOE, [name]) == {name: (7, 7)}

"""Config values a derived plan uses are checked (issue 26, item 9): head counts and sizes from config.json
must be positive integers that divide what they must, or deriving the manifest fails with one
`ManifestError` naming the field. Valid configs plan exactly as before.

Before, `num_key_value_heads: 0` fell back to `num_attention_heads` (at tp=4 rank r got half of a real kv
head), and `num_attention_heads` of 0, -4 or "4" dropped the head-boundary split, so tp=8 planned where the
valid config refuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reshard.errors import ManifestError, PlanError
from reshard.format.checkpoint import Checkpoint
from reshard.plan.planner import make_plan
from reshard.rules.from_config import from_config
from reshard.rules.manifest import Manifest
from reshard.testing.synth import llama_config, make_checkpoint, state_dict_shapes
from tests.support.plan_reference import plan_digest, reference_plan

pytestmark = pytest.mark.pure


def _names(config: dict[str, Any]) -> list[str]:
    return list(state_dict_shapes(config))


def _derive(model_type: str = "llama", **changes: Any) -> Manifest:
    """The manifest of a small checkpoint whose config.json is changed (after its tensors are named)."""
    config = llama_config(model_type=model_type)
    names = _names(config)
    return from_config({**config, **changes}, names)


BAD = [0, -4, "4", 4.0, True, [4]]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_num_attention_heads_must_be_a_positive_integer(value: Any) -> None:
    with pytest.raises(ManifestError) as e:
        _derive(num_attention_heads=value)
    assert str(e.value).startswith(f"config.json `num_attention_heads` = {value!r} ({type(value).__name__}) "
                                   "must be a positive integer"), str(e.value)


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_num_key_value_heads_must_be_a_positive_integer(value: Any) -> None:
    with pytest.raises(ManifestError, match=r"^config.json `num_key_value_heads` = .* must be a positive integer: "
                                            r"reshard splits k_proj / v_proj on kv-head boundaries"):
        _derive(num_key_value_heads=value)


def test_kv_heads_must_divide_the_heads() -> None:
    with pytest.raises(ManifestError, match=r"^config.json `num_key_value_heads` = 3 does not divide "
                                            r"num_attention_heads = 4"):
        _derive(num_key_value_heads=3)


def test_fused_qkv_needs_a_whole_head_size() -> None:
    """phi3's fused qkv_proj: without head_dim, hidden_size must be a multiple of the heads."""
    with pytest.raises(ManifestError, match=r"^config.json `hidden_size` = 66 is not a multiple of "
                                            r"num_attention_heads = 4, and config.json has no head_dim"):
        _derive("phi3", hidden_size=66, head_dim=None)
    with pytest.raises(ManifestError, match=r"^config.json `head_dim` = 0 \(int\) must be a positive integer"):
        _derive("phi3", head_dim=0)
    with pytest.raises(ManifestError, match=r"^config.json `intermediate_size` = '128' \(str\) must be a positive"):
        _derive("phi3", intermediate_size="128")


def test_an_attribute_mapped_field_is_named_as_config_json_spells_it() -> None:
    """GPT-J's config says `n_head` (transformers' attribute_map: num_attention_heads -> n_head)."""
    names = [f"transformer.h.0.attn.{p}_proj.weight" for p in "qkv"] + ["transformer.h.0.attn.out_proj.weight"]
    manifest = from_config({"model_type": "gptj", "n_head": 16, "n_embd": 64}, names)
    assert {r.pattern: r.options for r in manifest.rules}[r"transformer\.h\.\d+\.attn\.q_proj\.weight"] == {"heads": 16}
    with pytest.raises(ManifestError, match=r"^config.json `n_head` = '16' \(str\) must be a positive integer"):
        from_config({"model_type": "gptj", "n_head": "16", "n_embd": 64}, names)


def test_values_no_rule_uses_are_not_checked() -> None:
    """Llama's gate/up are plain colwise: intermediate_size sizes nothing; a null kv count means all heads."""
    assert _derive(intermediate_size="oops").to_dict() == _derive().to_dict()
    assert _derive(num_key_value_heads=None).to_dict() == _derive(num_key_value_heads=4).to_dict()


def test_the_issues_configs_refuse_where_they_planned(tmp_path: Path) -> None:
    """The valid config refuses tp=8 (4 heads); "4" planned it. kv heads 0 at tp=4 split k_proj as 4 heads."""
    config = llama_config()  # 4 heads, 2 kv heads
    ckpt = Checkpoint.open(make_checkpoint(tmp_path / "ckpt", config))
    with pytest.raises(PlanError, match="4 heads are not divisible by tp=8"):
        make_plan(ckpt, from_config(config, list(ckpt.tensors)), 8)
    with pytest.raises(ManifestError, match="`num_attention_heads` = '4'"):
        from_config({**config, "num_attention_heads": "4"}, list(ckpt.tensors))
    with pytest.raises(ManifestError, match="`num_key_value_heads` = 0"):
        from_config({**config, "num_key_value_heads": 0}, list(ckpt.tensors))


# the manifests the code derived before these checks (captured from it): valid configs give the same ones
LLAMA_BEFORE = [
    ({"regex": r"model\.embed_tokens\.weight", "kind": "vocab_embed", "pad": True}),
    ({"regex": r"model\.layers\.\d+\.self_attn\.q_proj\.weight", "kind": "column", "heads": 4}),
    ({"regex": r"model\.layers\.\d+\.self_attn\.k_proj\.weight", "kind": "column", "heads": 2, "replicate_heads": True}),
    ({"regex": r"model\.layers\.\d+\.self_attn\.v_proj\.weight", "kind": "column", "heads": 2, "replicate_heads": True}),
    ({"regex": r"model\.layers\.\d+\.self_attn\.o_proj\.weight", "kind": "row"}),
    ({"regex": r"model\.layers\.\d+\.mlp\.gate_proj\.weight", "kind": "column"}),
    ({"regex": r"model\.layers\.\d+\.mlp\.up_proj\.weight", "kind": "column"}),
    ({"regex": r"model\.layers\.\d+\.mlp\.down_proj\.weight", "kind": "row"}),
    ({"regex": r"lm_head\.weight", "kind": "column", "pad": True, "gather_output": True}),
]
PHI3_BEFORE = [
    {"regex": r"model\.embed_tokens\.weight", "kind": "vocab_embed", "pad": True},
    {"regex": r"model\.layers\.\d+\.self_attn\.o_proj\.weight", "kind": "row"},
    {"regex": r"model\.layers\.\d+\.self_attn\.qkv_proj\.weight", "kind": "packed_column", "blocks": [64, 32, 32],
     "heads": [4, 2, 2], "replicate_heads": [False, True, True]},
    {"regex": r"model\.layers\.\d+\.mlp\.gate_up_proj\.weight", "kind": "packed_column", "blocks": [128, 128]},
    {"regex": r"model\.layers\.\d+\.mlp\.down_proj\.weight", "kind": "row"},
    {"regex": r"lm_head\.weight", "kind": "column", "pad": True, "gather_output": True},
]


@pytest.mark.parametrize(("model_type", "before"), [("llama", LLAMA_BEFORE), ("phi3", PHI3_BEFORE)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_valid_configs_plan_as_before(tmp_path: Path, model_type: str, before: list[dict[str, Any]], tp: int) -> None:
    config = llama_config(model_type=model_type)
    ckpt = Checkpoint.open(make_checkpoint(tmp_path / "ckpt", config))
    derived = from_config(config, list(ckpt.tensors))
    assert sorted(derived.to_dict()["rules"], key=str) == sorted(before, key=str)
    want = reference_plan(ckpt, Manifest.from_dict({"rules": before}), tp)
    assert plan_digest(make_plan(ckpt, derived, tp).ranks) == plan_digest(want)


# --- RESHARD_MLA=heads: DeepSeek's MLA projections split on head boundaries (reshard.rules.tp_plans.mla) ---

MLA_NAMES = [f"model.layers.{i}.self_attn.{leaf}.weight" for i in range(2) for leaf in
             ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]
MLA_CONFIG = {"model_type": "deepseek_v3", "kv_lora_rank": 16, "num_attention_heads": 4}


def _mla_rules(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> dict[str, dict[str, Any]]:
    """The MLA rules derived with RESHARD_MLA=heads: pattern -> the rule's kind and options."""
    monkeypatch.setenv("RESHARD_MLA", "heads")
    rules = from_config({**MLA_CONFIG, **changes}, MLA_NAMES).to_dict()["rules"]
    return {r["regex"]: {k: v for k, v in r.items() if k != "regex"} for r in rules if "self_attn" in r["regex"]}


@pytest.mark.parametrize("value", [0, -4, "4", 4.0, True], ids=repr)
def test_mla_heads_must_be_a_positive_integer(monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    """Before, each of these returned no MLA rule at all: every projection replicated, silently."""
    with pytest.raises(ManifestError) as e:
        _mla_rules(monkeypatch, num_attention_heads=value)
    assert str(e.value) == (
        f"config.json `num_attention_heads` = {value!r} ({type(value).__name__}) must be a positive integer: "
        "reshard splits attention projections on head boundaries with it; fix config.json or write a rules file")


def test_mla_heads_of_a_valid_config_split_by_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    want_column = {"kind": "column", "heads": 4}
    assert _mla_rules(monkeypatch) == {
        r"(.*\.)?self_attn\.q_b_proj\.(weight|bias)": want_column,
        r"(.*\.)?self_attn\.kv_b_proj\.(weight|bias)": want_column,
        r"(.*\.)?self_attn\.o_proj\.(weight|bias)": {"kind": "row"},
        r"(.*\.)?self_attn\.kv_a_proj_with_mqa\.(weight|bias)": {"kind": "replicate", "hf_style": "mla_kv_a_proj"},
    }
    # absent: the config class's default, as transformers reads it (DeepSeek-V3: 128 heads)
    absent = {k: v for k, v in MLA_CONFIG.items() if k != "num_attention_heads"}
    monkeypatch.setenv("RESHARD_MLA", "heads")
    rules = from_config(absent, MLA_NAMES).to_dict()["rules"]
    assert [r["heads"] for r in rules if r.get("kind") == "column" and "self_attn" in r["regex"]] == [128, 128]
    monkeypatch.delenv("RESHARD_MLA")  # off: transformers' plan replicates MLA, and the count is not read
    off = from_config({**MLA_CONFIG, "num_attention_heads": "4"}, MLA_NAMES)
    assert off.rules == from_config(MLA_CONFIG, MLA_NAMES).rules
    assert not any("self_attn" in r.pattern for r in off.rules)

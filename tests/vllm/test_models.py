"""vLLM's own model, built in this process and filled by load_format="reshard", equals vLLM's default load
parameter by parameter (tests/support/vllm_models.py: no engine, well under a second a build); the plan the
plugin asks for comes from the shipped table whatever transformers vLLM pins beside it; the loader's `rules`
key chooses a manifest stored on the service."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

import reshard.rules.tp_plans as tp_plans
from reshard.errors import ReshardError
from reshard.rules.from_config import from_config
from tests.support.live import LiveServer
from tests.support.vllm_ckpts import MODELS
from tests.support.vllm_models import loaded, loaded_by_reshard, store_rules

pytestmark = pytest.mark.servers


@pytest.mark.parametrize("name", list(MODELS))
def test_every_parameter_equals_vllms_default_load(name: str, vroot: Path, meta_dir: Callable[[str], Path],
                                                   vwritten: Callable[..., Path]) -> None:
    want = loaded(vroot / name)  # vLLM's default loader on the full checkpoint
    got = loaded_by_reshard(meta_dir(name), shards=str(vwritten(name, 1)))
    assert list(got) == list(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    # every parameter comes from the checkpoint: other weights change each one, biases and norms included
    other = loaded(vroot.parent / "others" / name)
    assert [n for n in want if torch.equal(other[n], want[n])] == []


def test_qwen2_moe_experts_are_split_by_the_shipped_table_not_by_the_installed_transformers(
        vroot: Path, vwritten: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.19 (vLLM's pin) plans qwen2_moe's experts replicated; the shipped 5.24 table splits them,
    and that is what a rank gets unless RESHARD_PLAN_SOURCE=live asks for the installed plans."""
    assert transformers.__version__.startswith("5.19.")
    ckpt = vroot / "qwen2_moe"
    config = json.loads((ckpt / "config.json").read_text())
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        gate = f.get_tensor("model.layers.0.mlp.experts.1.gate_proj.weight")
    monkeypatch.delenv(tp_plans.SOURCE_ENV, raising=False)
    table = from_config(config, names)
    assert table.source.startswith("shipped plan table (transformers 5.24")
    expert = {n: (r.kind if (r := table.match(n)) else None) for n in names if ".experts.1." in n}
    assert set(expert.values()) == {"column", "row"}  # gate/up by rows, down by columns
    with safe_open(str(vwritten("qwen2_moe", 2) / "rank-00001-of-00002.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.mlp.experts.1.gate_proj.weight"), gate.chunk(2)[1])
    monkeypatch.setenv(tp_plans.SOURCE_ENV, "live")
    live = from_config(config, names)
    assert live.source.startswith("transformers 5.19")
    assert {n: live.match(n) for n in expert} == dict.fromkeys(expert)  # no rule: every expert replicated


def test_the_rules_key_chooses_a_manifest_stored_on_the_service(vserver: LiveServer, vroot: Path,
                                                                meta_dir: Callable[[str], Path]) -> None:
    url = vserver.ckpt_url("llama")
    store_rules(url, "plugin")
    want = loaded(vroot / "llama")
    got = loaded_by_reshard(meta_dir("llama"), url=url, rules="plugin")
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    with pytest.raises(ReshardError, match=r"HTTP 404 .*checkpoint 'llama' has no stored manifest 'nolabel'; "
                                           r"stored: \['plugin'\]"):
        loaded_by_reshard(meta_dir("llama"), url=url, rules="nolabel")

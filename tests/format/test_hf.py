"""HF-style multi-file checkpoints planned from config.json alone (built-in plans and base_model_tp_plan).

`reshard plan CKPT --tp N` says which plan it used; `reshard write CKPT --tp 4 -o OUT` needs no rules
file, and every rank file holds what torch computes from the original tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import __version__ as INSTALLED

from reshard.format.checkpoint import Checkpoint
from reshard.format.rank_file import rank_file_name
from reshard.rules.tp_plans.entry import table_version
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.core import assert_same, even_chunk, head_chunk, padded_chunk, run_cli, sha256_file

pytestmark = pytest.mark.pure

# the plan source a write names by default: the shipped table, which is that release's plans where it is installed
# (the pinned lane) and says so, else named as the table of its release (the newest-versions lane)
SOURCE = ("transformers {v} plan" if INSTALLED == table_version() else "shipped plan table (transformers {v})").format(
    v=table_version())

SIZES = {"vocab_size": 250, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def load_all(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(root.glob("model*.safetensors")):
        out.update(load_file(str(p)))
    return out


def expected_hf(name: str, t: torch.Tensor, config: dict[str, Any], rank: int, tp: int,
                sharded: set[str] | None = None) -> torch.Tensor:
    """The piece of HF tensor `name` rank `rank` gets under the llama/phi3 TP plan (torch alone).

    `sharded`: when given, only modules whose name contains one of these are sharded (a custom plan).
    """
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = config["head_dim"], config["intermediate_size"]
    if sharded is not None and not any(s in name for s in sharded) and "embed_tokens" not in name \
            and "lm_head" not in name:
        return t
    if name == "model.embed_tokens.weight" or name == "lm_head.weight":
        return padded_chunk(t, tp, rank, 0)
    if ".q_proj." in name:
        return head_chunk(t, nh, tp, rank)
    if ".k_proj." in name or ".v_proj." in name:
        return head_chunk(t, nkv, tp, rank)
    if ".qkv_proj." in name:
        q, k, v = torch.split(t, [nh * hd, nkv * hd, nkv * hd])
        return torch.cat([head_chunk(q, nh, tp, rank), head_chunk(k, nkv, tp, rank), head_chunk(v, nkv, tp, rank)])
    if ".gate_up_proj." in name:
        gate, up = torch.split(t, [inter, inter])
        return torch.cat([even_chunk(gate, tp, rank), even_chunk(up, tp, rank)])
    if ".gate_proj." in name or ".up_proj." in name:
        return even_chunk(t, tp, rank, 0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return even_chunk(t, tp, rank, 1)
    return t  # norms, o_proj bias


def check_written(out: Path, ckpt: Path, tp: int, sharded: set[str] | None = None) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_all(ckpt)
    record = json.loads((out / "reshard.json").read_text())
    assert (out / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    for rank in range(tp):
        path = out / rank_file_name(rank, tp)
        assert record["files"][path.name]["sha256"] == sha256_file(path)
        got = load_file(str(path))
        assert sorted(got) == sorted(tensors)
        for name, t in tensors.items():
            assert_same(got[name], expected_hf(name, t, config, rank, tp, sharded), f"{name} rank {rank}/{tp}")


@pytest.mark.parametrize(
    "model_type, num_files", [("llama", 3), ("qwen2", 2), ("phi3", 3)], ids=["llama", "qwen2", "phi3"]
)
def test_plan_and_write_from_config_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model_type: str, num_files: int
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", llama_config(model_type=model_type, **SIZES),
                           dtype=torch.bfloat16, num_files=num_files, seed=5)
    assert (ckpt / "model.safetensors.index.json").is_file()
    assert len(Checkpoint.open(ckpt).files) == num_files
    if model_type == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.weight" in load_all(ckpt)
    rc, out, err = run_cli(["plan", ckpt, "--tp", 2], capsys)
    assert (rc, err) == (0, "")
    assert f"manifest:   {SOURCE} for model_type '{model_type}'" in out
    assert "tp=2" in out
    rc, out, err = run_cli(["write", ckpt, "--tp", 4, "-o", tmp_path / "out"], capsys)
    assert (rc, err) == (0, "")
    assert "wrote 4 rank files" in out and f"{SOURCE} for model_type '{model_type}'" in out
    check_written(tmp_path / "out", ckpt, 4)


def test_qwen2_biases_follow_their_heads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """q/k/v biases are split like their weights' rows: kv biases replicated per head at tp=4."""
    ckpt = make_checkpoint(tmp_path / "ckpt", llama_config(model_type="qwen2", **SIZES), num_files=1, seed=6)
    rc, _, err = run_cli(["write", ckpt, "--tp", 4, "-o", tmp_path / "out"], capsys)
    assert (rc, err) == (0, "")
    k_bias = load_file(str(ckpt / "model.safetensors"))["model.layers.1.self_attn.k_proj.bias"]
    hd = 8
    for rank in range(4):
        got = load_file(str(tmp_path / "out" / rank_file_name(rank, 4)))["model.layers.1.self_attn.k_proj.bias"]
        assert_same(got, k_bias[(rank // 2) * hd : (rank // 2 + 1) * hd])


def test_base_model_tp_plan_in_config_wins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An explicit base_model_tp_plan (sharding only the MLP) is used instead of the llama built-in plan."""
    ckpt = make_checkpoint(tmp_path / "ckpt", llama_config(**SIZES), dtype=torch.float16, num_files=2, seed=7)
    config = json.loads((ckpt / "config.json").read_text())
    config["base_model_tp_plan"] = {
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    rc, out, err = run_cli(["plan", ckpt, "--tp", 2], capsys)
    assert (rc, err) == (0, "")
    assert "manifest:   config.json base_model_tp_plan" in out
    rc, out, err = run_cli(["write", ckpt, "--tp", 4, "-o", tmp_path / "out"], capsys)
    assert (rc, err) == (0, "")
    check_written(tmp_path / "out", ckpt, 4, sharded={"mlp."})
    # attention stays whole on every rank under this plan
    q = load_all(ckpt)["model.layers.0.self_attn.q_proj.weight"]
    got = load_file(str(tmp_path / "out" / rank_file_name(3, 4)))["model.layers.0.self_attn.q_proj.weight"]
    assert_same(got, q)


def test_plan_json_names_plan_source_and_kinds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", llama_config(**SIZES), num_files=2, seed=8)
    rc, out, err = run_cli(["plan", ckpt, "--tp", 2, "--json"], capsys)
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert doc["manifest_source"].startswith(f"{SOURCE} for model_type 'llama'")
    kinds = {t["name"]: t["kind"] for t in doc["ranks"][0]["tensors"]}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "column"
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == "row"
    assert kinds["model.layers.1.mlp.down_proj.weight"] == "row"
    assert kinds["model.embed_tokens.weight"] == "vocab_embed"
    assert kinds["lm_head.weight"] == "column"
    assert kinds["model.norm.weight"] == "replicate"
    emb = next(t for t in doc["ranks"][1]["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert emb["shape"] == [125, 32] and emb["select"] == [[[125, 250]], [[0, 32]]]


@pytest.mark.pure
def test_checkpoint_json_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """parse_json: a checkpoint's JSON as json.loads reads it, but one line for what is not UTF-8 JSON, past
    the size limit or nested too deep (100,000 `[` too: no RecursionError escapes)."""
    import reshard.format.checkpoint as ck
    from reshard.errors import CheckpointError

    cfg = {"model_type": "llama", "rope_scaling": {"factor": 2.0}, "layer_types": ["full"] * 3}
    assert ck.parse_json(json.dumps(cfg).encode(), "config.json") == cfg and ck.parse_json(b"null", "x") is None
    for raw, says in ((b"[" * 100_000, "nested deeper than 64"), (b"[" * 65 + b"]" * 65, "nested deeper than 64"),
                      (b"{bad", "not valid JSON"), (b"\xff", "not valid JSON")):
        with pytest.raises(CheckpointError, match=f"^config.json: .*{says}"):
            ck.parse_json(raw, "config.json")
    assert ck.parse_json(b"[" * 64 + b"]" * 64, "x") is not None
    monkeypatch.setattr(ck, "JSON_MAX_BYTES", 10)
    with pytest.raises(CheckpointError, match="11 bytes of JSON, more than the 10-byte limit"):
        ck.parse_json(b'{"a": 1234}', "config.json")

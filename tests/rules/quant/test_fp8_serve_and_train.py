"""FP8 shards from a real `reshard serve`, and TP models built from FP8 shards (dequantized on fill)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.errors import PlanError
from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.hf_checkpoint import merge
from reshard.testing.synth import llama_config
from reshard.trainer import build_model, save_rank_shard
from tests.support.dist import run_distributed
from tests.support.fp8_ckpt import BLOCK_QC, ct_qc, dequantized_state, fp8_checkpoint, write
from tests.support.live import live_server


@pytest.mark.servers
def test_service_streams_fp8_shards_byte_identical_to_write(ckpts: Path, shards: Any, tmp_path: Path) -> None:
    with live_server(ckpts, log_dir=tmp_path, chunk_size=64 << 10) as srv:
        for case, tp in (("block", 4), ("block_phi3", 2), ("tensor", 2)):
            for rank in range(tp):
                r = httpx.get(f"{srv.ckpt_url(case)}/shards/{rank}", params={"tp": tp}, timeout=60)
                assert r.status_code == 200, r.text
                assert r.content == (shards(case, tp) / rank_file_name(rank, tp)).read_bytes(), (case, tp, rank)
        assert "Traceback" not in srv.log()


# hidden 144 is 4.5 blocks of 32: partial ceil blocks in every column weight's inputs and row weight's outputs
TRAIN_CONFIG = llama_config(hidden_size=144, num_attention_heads=4, head_dim=32, num_key_value_heads=2,
                            intermediate_size=256, num_hidden_layers=2, vocab_size=301)
TRAIN_QCS = {"block": {**BLOCK_QC, "weight_block_size": [32, 32]}, "channel": ct_qc("channel")}
IDS = torch.randint(0, 301, (2, 10), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def train_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per scheme: the FP8 checkpoint, the same dequantized (float32, no quantization_config), and
    their tp=1 and tp=2 rank shards."""
    root = tmp_path_factory.mktemp("fp8_train")
    out = {}
    for name, qc in TRAIN_QCS.items():
        fp8 = fp8_checkpoint(root / f"{name}-fp8", TRAIN_CONFIG, qc, seed=7)
        deq = root / f"{name}-deq"
        deq.mkdir()
        save_file(dequantized_state(fp8, qc), str(deq / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((fp8 / "config.json").read_text())
        del config["quantization_config"]
        (deq / "config.json").write_text(json.dumps(config))
        out[name] = deq
        for kind, src in (("fp8", fp8), ("deq", deq)):
            for tp in (1, 2):
                out[f"{name}-{kind}-tp{tp}"] = write(src, tp, root / f"{name}-{kind}-tp{tp}")
    return out


def _logits_job(rank: int, world_size: int, dirs: dict[str, str], ids: torch.Tensor) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, path in dirs.items():
        for dtype in (torch.float32, torch.bfloat16):
            model = build_model(path, dtype=dtype).eval()
            with torch.no_grad():
                out[(name, str(dtype))] = model(input_ids=ids).logits.float()
        if "fp8" in name:
            try:
                build_model(path)  # keep: FP8 as stored
            except PlanError as e:
                out[(name, "keep")] = str(e)
    return out


@pytest.mark.multiproc
def test_tp2_models_from_fp8_match_the_dequantized_checkpoint(train_dirs: dict[str, Path]) -> None:
    dirs = {f"{s}-{k}": str(train_dirs[f"{s}-{k}-tp2"]) for s in TRAIN_QCS for k in ("fp8", "deq")}
    ranks = run_distributed(_logits_job, 2, dirs, IDS, timeout=300)
    for scheme in TRAIN_QCS:
        from transformers import AutoModelForCausalLM  # the unsharded model of the dequantized checkpoint

        reference = AutoModelForCausalLM.from_pretrained(train_dirs[scheme], dtype=torch.float32)
        with torch.no_grad():
            unsharded = reference.eval()(input_ids=IDS).logits
        assert unsharded.abs().max() > 0.1
        for got in ranks:
            fp32, deq32 = got[(f"{scheme}-fp8", "torch.float32")], got[(f"{scheme}-deq", "torch.float32")]
            torch.testing.assert_close(fp32, deq32, atol=1e-5, rtol=0)
            torch.testing.assert_close(fp32, unsharded, atol=1e-4, rtol=0)
            bf16, deq16 = got[(f"{scheme}-fp8", "torch.bfloat16")], got[(f"{scheme}-deq", "torch.bfloat16")]
            torch.testing.assert_close(bf16, deq16, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(bf16, unsharded, atol=5e-2, rtol=5e-2)
            assert "--dtype keep" in got[(f"{scheme}-fp8", "keep")]
            assert "pass --dtype bfloat16 or float32" in got[(f"{scheme}-fp8", "keep")]


@pytest.mark.pure
def test_a_model_started_from_fp8_saves_and_merges_dequantized(train_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = build_model(train_dirs["block-fp8-tp1"], dtype=torch.float32)
    save_rank_shard(model, tmp_path / "saved", config=model.hf_config)
    merge(tmp_path / "saved", tmp_path / "merged", progress=False)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    expected = load_file(train_dirs["block"] / "model.safetensors")
    assert merged.keys() == expected.keys()  # no scales
    for name, t in expected.items():
        assert torch.equal(merged[name], t), name


@pytest.mark.pure
def test_fp8_shards_without_a_recorded_block_are_refused_not_cast(train_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Shards written by a rules file of plain kinds hold FP8 weights with no scale block: filling
    them would cast FP8 codes without their scales, so it is an error."""
    rules = tmp_path / "plain.yaml"
    rules.write_text("rules: []\n")
    fp8 = train_dirs["block-fp8-tp1"].parent / "block-fp8"
    out = write(fp8, 1, tmp_path / "plain", "--rules", str(rules))
    with pytest.raises(PlanError, match=r"weight: FP8 with .*weight_scale_inv beside it, but its kind 'replicate'"):
        build_model(out, dtype=torch.float32)

"""Int4 shards (GPTQ, AWQ, compressed-tensors) from a real `reshard serve`, `fill_model` into a consumer that
holds the packed tensors as stored (vLLM's way), and the refusals where packed bytes would land in a
dequantized parameter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import PlanError
from reshard.format.rank_file import rank_file_name
from reshard.testing.synth import llama_config
from tests.support.dist import run_distributed
from tests.support.fill_checks import Holder
from tests.support.fp8_ckpt import write
from tests.support.int4_ckpt import (
    awq_qc,
    ct_qc,
    format_of,
    gptq_qc,
    int4_checkpoint,
    logical_index,
    modules,
    rank_groups,
    stored_index,
)
from tests.support.live import live_server

CONFIG = llama_config(hidden_size=128, num_attention_heads=4, head_dim=32, num_key_value_heads=2,
                      intermediate_size=256, num_hidden_layers=1, vocab_size=128)
QCS = {"gptq": gptq_qc(32), "awq": awq_qc(32), "ct": ct_qc(32, sym=False)}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("int4_serve") / "root"
    for seed, (name, qc) in enumerate(QCS.items()):
        int4_checkpoint(base / name, CONFIG, qc, seed=seed)
    return base


@pytest.mark.servers
def test_service_streams_int4_shards_byte_identical_to_write(root: Path, tmp_path: Path) -> None:
    written = {(case, tp): write(root / case, tp, tmp_path / f"{case}-{tp}") for case in QCS for tp in (2, 4)}
    with live_server(root, log_dir=tmp_path, chunk_size=64 << 10) as srv:
        for (case, tp), out in written.items():
            for rank in range(tp):
                r = httpx.get(f"{srv.ckpt_url(case)}/shards/{rank}", params={"tp": tp}, timeout=60)
                assert r.status_code == 200, r.text
                assert r.content == (out / rank_file_name(rank, tp)).read_bytes(), (case, tp, rank)
        bad = httpx.get(f"{srv.ckpt_url('gptq')}/shards/0", params={"tp": 8}, timeout=60)  # o_proj: 16 inputs
        assert bad.status_code == 422 and bad.json()["error"] == "PlanError", bad.text
        assert "inside one GPTQ group (32 values)" in bad.json()["detail"]
        assert "Traceback" not in srv.log()


def rank_tensors(case: str, full: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor as rank `rank` of `tp` holds it, by the TP math: the quantized modules' parts, the
    vocabulary's rows (embeddings, lm_head), the rest (norms) whole."""
    fmt = format_of(QCS[case])[0]
    out = {n: full[n].chunk(tp)[rank] if n in ("model.embed_tokens.weight", "lm_head.weight") else full[n]
           for n in full if n.endswith("norm.weight") or n in ("model.embed_tokens.weight", "lm_head.weight")}
    for stem, parts in modules(full, fmt).items():
        rows, cols = logical_index(stem, CONFIG, tp, rank)
        scales = parts.get("scales", parts.get("weight_scale"))
        held = rank_groups(QCS[case], cols, scales.shape[1 if fmt == "ct" else 0])
        for suffix, t in parts.items():
            want = t
            for d, idx in enumerate(stored_index(fmt, suffix, rows, cols, held, tuple(t.shape))):
                want = want.index_select(d, idx)
            out[f"{stem}.{suffix}"] = want
    return out


def _fill_job(rank: int, world: int, root: str, shards: dict[str, str]) -> dict[str, Any]:
    from reshard.fill.model import fill_model

    out: dict[str, Any] = {}
    wants = {case: rank_tensors(case, load_file(str(Path(root) / case / "model.safetensors")), world, rank)
             for case in shards}
    for case, want in wants.items():
        model = Holder({n: (tuple(t.shape), t.dtype) for n, t in want.items()})
        fill_model(model, shards[case])
        out[case] = [n for n, p in model.named_parameters() if not torch.equal(p, want[n])], len(want)
    scales = "model.layers.0.self_attn.o_proj.scales"  # a float32 parameter where the shard holds float16
    wrong = Holder({n: (tuple(t.shape), torch.float32 if n == scales else t.dtype) for n, t in wants["gptq"].items()})
    try:
        fill_model(wrong, shards["gptq"])
        out["refused"] = ""
    except PlanError as e:
        out["refused"] = str(e)
    return out


@pytest.mark.multiproc
def test_fill_model_into_packed_parameters(root: Path, tmp_path: Path) -> None:
    """Two gloo ranks fill packed parameters of their shapes (vLLM's) from `reshard write` shards: each gets
    the checkpoint's bytes of its rows and inputs; a float32 parameter for a packed format's scale is refused."""
    shards = {case: str(write(root / case, 2, tmp_path / case)) for case in QCS}
    ranks = run_distributed(_fill_job, 2, str(root), shards, timeout=300)
    for res in ranks:
        assert {case: res[case] for case in QCS} == {"gptq": ([], 33), "awq": ([], 26), "ct": ([], 33)}
        assert "o_proj.scales: GPTQ: int4 packed 8 per int32 along K" in res["refused"]
        assert "into a float32 parameter" in res["refused"]


@pytest.mark.pure
def test_the_trainer_refuses_int4_shards(root: Path, tmp_path: Path) -> None:
    from reshard.trainer import build_model

    out = write(root / "awq", 1, tmp_path / "tp1")
    with pytest.raises(PlanError, match=r"qweight: AWQ: int4 packed 8 per int32 along N .* cannot dequantize them"):
        build_model(out, dtype=torch.float32)

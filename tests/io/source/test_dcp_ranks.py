"""DCP checkpoints of 2 FSDP2 ranks with uneven chunks, made by torch and by transformers in real gloo
processes, as sources; and rank files read back by torch's own `HuggingFaceStorageReader` into DTensor
models (FSDP2, and TP by `parallelize_module`) with torch alone.

The checkpoint's hidden size is 65 (tests/support/dcp_ckpts.py), so FSDP2 saves o_proj, down_proj and the
norms as chunks of 33 and 32 rows; `reshard write` from `dcp.save`'s directory and from transformers'
`save_pretrained(..., distributed_checkpoint=True)` equals `reshard write` from the HF checkpoint byte for
byte, and `reshard merge` gives back its tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main
from reshard.io.sinks.hf_checkpoint import merge
from tests.support.dcp_ckpts import hf_ckpt, load_rank_files, save_fsdp_ranks
from tests.support.dist import run_distributed

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("dcp-ranks")
    ckpt = hf_ckpt(root / "hf")
    local = run_distributed(save_fsdp_ranks, 2, str(ckpt), str(root / "dcp"), str(root / "transformers"))
    shutil.copy(ckpt / "config.json", root / "dcp" / "config.json")  # transformers writes its own
    return {"hf": ckpt, "dcp": root / "dcp", "transformers": root / "transformers", "local": local}


def _rank_files(src: Path, out: Path, *args: str) -> dict[str, bytes]:
    assert main(["write", str(src), *args, "-o", str(out), "--no-progress"]) == 0
    return {p.name: p.read_bytes() for p in sorted(out.glob("rank-*.safetensors"))}


def test_chunks_were_uneven(saved: dict[str, object]) -> None:
    local = saved["local"]
    assert local[0]["model.layers.0.mlp.down_proj.weight"] == [33, 128]  # type: ignore[index]
    assert local[1]["model.layers.0.mlp.down_proj.weight"] == [32, 128]  # type: ignore[index]
    assert local[1]["model.norm.weight"] == [32]  # type: ignore[index]
    assert sorted(p.name for p in saved["transformers"].glob("*.safetensors")) == [  # type: ignore[attr-defined]
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("kind", ["dcp", "transformers"])
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--fsdp", "2", "--tp", "2"]], ids=["tp2", "fsdp2tp2"])
def test_write_equals_write_from_the_checkpoint(saved: dict[str, Path], tmp_path: Path, kind: str, layout: list[str]) -> None:
    want = _rank_files(saved["hf"], tmp_path / "hf", *layout)
    assert _rank_files(saved[kind], tmp_path / kind, *layout) == want and want


@pytest.mark.parametrize("kind", ["dcp", "transformers"])
def test_merge_gives_back_the_tensors(saved: dict[str, Path], tmp_path: Path, kind: str) -> None:
    summary = merge(saved[kind], tmp_path / "merged", progress=False)
    got = load_file(tmp_path / "merged" / summary["files"][0])
    want = load_file(saved["hf"] / "model.safetensors")
    assert summary["files"] == ["model.safetensors"] and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--fsdp", "2", "--tp", "2"]], ids=["tp2", "fsdp2tp2"])
def test_torch_reads_rank_files_into_dtensor_models(saved: dict[str, Path], tmp_path: Path, layout: list[str]) -> None:
    """`dcp.load(sd, storage_reader=HuggingFaceStorageReader(DIR))` on rank files of tp=2 (and of
    fsdp=2 x tp=2: four files, replicated tensors in two of them) fills FSDP2 and TP models with the
    checkpoint's values, with torch alone."""
    shards = tmp_path / "shards"
    _rank_files(saved["hf"], shards, *layout)
    found = run_distributed(load_rank_files, 2, str(saved["hf"]), str(shards))
    names = sorted(load_file(saved["hf"] / "model.safetensors"))
    for rank in found:
        assert rank["fsdp"]["differ"] == [] and rank["tp"]["differ"] == []
        assert rank["fsdp"]["loaded"] == names and rank["fsdp"]["sharded"] == names  # every parameter an FSDP2 DTensor
        assert "model.layers.0.self_attn.o_proj.weight" in rank["tp"]["sharded"]

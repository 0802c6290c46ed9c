"""DCP checkpoints of 2 FSDP2 ranks with uneven chunks, made by torch and by transformers in real gloo
processes, as sources; and rank files read back by torch's own `HuggingFaceStorageReader` into DTensor
models (FSDP2, and TP by `parallelize_module`) with torch alone.

The checkpoint's hidden size is 65 (tests/support/dcp_ckpts.py), so FSDP2 saves o_proj, down_proj and the
norms as chunks of 33 and 32 rows; `reshard write` from `dcp.save`'s directory and from transformers'
`save_pretrained(..., distributed_checkpoint=True)` equals `reshard write` from the HF checkpoint byte for
byte, and `reshard merge` gives back its tensors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main
from reshard.io.sinks.hf_checkpoint import merge
from tests.support.dcp_ckpts import hf_ckpt, load_rank_files, save_fsdp_ranks
from tests.support.dist import run_distributed
from tests.support.peak_rss import PRELUDE

pytestmark = pytest.mark.multiproc

MiB = 1 << 20
MERGE = PRELUDE + r"""
import json, sys
import torch  # noqa: F401  (its import is part of the baseline, not of the merge)
from reshard.io.sinks.hf_checkpoint import merge

before = reset_peak()
summary = merge(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"before": before, "after": status("VmHWM"), "bytes": summary["bytes"]}))
"""


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


def test_merge_holds_no_tensor_in_memory(tmp_path: Path) -> None:
    """Merging a 192 MiB DCP checkpoint (two 96 MiB tensors, one saved as two chunks) raises a fresh
    process's peak RSS by a few stream chunks, not a tensor (`dcp_to_torch_save` holds the state dict)."""
    import torch.distributed.checkpoint as dcp

    rows = 96 * MiB // 4 // 8192
    big = torch.arange(rows * 8192, dtype=torch.float32).reshape(rows, 8192)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"a.weight": big, "b.weight": big.flip(0)}, checkpoint_id=str(tmp_path / "dcp"))
    del big
    proc = subprocess.run([sys.executable, "-c", MERGE, str(tmp_path / "dcp"), str(tmp_path / "merged")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    assert m["bytes"] == 192 * MiB
    assert m["after"] - m["before"] < 40 * MiB, f"peak RSS rose by {(m['after'] - m['before']) / MiB:.1f} MiB"
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert torch.equal(merged["b.weight"][0], torch.arange((rows - 1) * 8192, rows * 8192, dtype=torch.float32))

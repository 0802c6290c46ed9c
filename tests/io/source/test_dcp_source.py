"""torch DCP checkpoints as a source (`reshard.io.source.dcp_dir`), made by torch itself in one process.

`reshard write` from `dcp.save`'s directory (the model's state dict under a "model" key, beside an
optimizer's state and a step counter) and from `HuggingFaceStorageWriter(save_distributed=True)`'s equals `reshard write` from the HF
checkpoint byte for byte; `reshard merge` gives back the checkpoint's tensors; a `.metadata` that would run
code is refused and runs nothing; transformed (compressed) items, transposed tensors, missing chunks and
truncated files are refused with one line each. The FSDP2 and transformers-distributed saves are in
test_dcp_ranks.py; stores, HTTP and the service in test_dcp_stores.py.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main
from reshard.errors import CheckpointError, ManifestError
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.source.dcp_dir import DcpCheckpoint
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from tests.support.dcp_ckpts import Payload, dcp_save, hf_ckpt, hf_writer_save

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dcp")
    ckpt = hf_ckpt(root / "hf")
    return {"hf": ckpt, "dcp": dcp_save(ckpt, root / "dcp", wrap=True), "flat": dcp_save(ckpt, root / "flat", wrap=False),
            "hf_writer": hf_writer_save(ckpt, root / "hf_writer")}


def _write(src: Path, out: Path, *args: str) -> Path:
    assert main(["write", str(src), *args, "-o", str(out), "--no-progress"]) == 0
    return out


def _rank_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("rank-*.safetensors"))}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("kind", ["dcp", "flat", "hf_writer"])
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--fsdp", "2"], ["--tp", "2", "--pp", "2"]], ids=["tp2", "fsdp2", "tp2pp2"])
def test_write_from_dcp_equals_write_from_the_checkpoint(made: dict[str, Path], tmp_path: Path, kind: str,
                                                         layout: list[str]) -> None:
    want = _rank_files(_write(made["hf"], tmp_path / "from-hf", *layout))
    got = _rank_files(_write(made[kind], tmp_path / "from-dcp", *layout))
    assert len(want) == (4 if "--pp" in layout else 2) and got == want


def test_dcp_source_reads_in_place(made: dict[str, Path]) -> None:
    """Each chunk is a piece pointing at its raw bytes inside a `.distcp` file; a tp=2 rank reads what it
    would read from the HF checkpoint, not all of it."""
    src, manifest = open_source(made["dcp"])
    assert isinstance(src, DcpCheckpoint) and src.kind == "dcp"
    assert src.left_out == ("optimizer.state.lm_head.weight.exp_avg", "optimizer.state.model.norm.weight.exp_avg", "step")
    hf = load_file(made["hf"] / "model.safetensors")
    assert sorted(src.tensors) == sorted(hf)
    for name, gt in src.tensors.items():
        (piece,) = gt.pieces
        assert piece.info.file.suffix == ".distcp" and gt.shape == tuple(hf[name].shape)
        with open(piece.info.file, "rb") as f:
            f.seek(piece.info.start)
            raw = f.read(piece.info.nbytes)
        assert raw == hf[name].numpy().tobytes(), name  # the bytes in place are the tensor's, row-major
    hf_src, hf_manifest = open_source(made["hf"])
    read = [rp.stats() for rp in make_plan(src, manifest, 2).ranks]
    assert read == [rp.stats() for rp in make_plan(hf_src, hf_manifest, 2).ranks]
    assert max(r["bytes_read"] for r in read) < 0.7 * src.total_bytes()


@pytest.mark.parametrize("kind", ["dcp", "hf_writer"])
def test_merge_gives_back_the_checkpoint(made: dict[str, Path], tmp_path: Path, kind: str) -> None:
    summary = merge(made[kind], tmp_path / "merged", max_file_bytes=150_000, progress=False)
    assert len(summary["files"]) > 1 and summary["source"] == ("dcp" if kind == "dcp" else "dcp-safetensors")
    got = {}
    for f in summary["files"]:
        got.update(load_file(tmp_path / "merged" / f))
    want = load_file(made["hf"] / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "merged" / "config.json").read_bytes() == (made["hf"] / "config.json").read_bytes()


def test_safetensors_serialized_distcp(made: dict[str, Path], tmp_path: Path) -> None:
    """`FileSystemWriter(serialization_format=SAFETENSORS)` (torch's own FileSystemReader cannot load it):
    chunks found through each file's DCP_SHARDING_INFO."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = load_file(made["hf"] / "model.safetensors")
    out = tmp_path / "st"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=FileSystemWriter(str(out), serialization_format=SerializationFormat.SAFETENSORS))
    shutil.copy(made["hf"] / "config.json", out / "config.json")
    assert _rank_files(_write(out, tmp_path / "a", "--tp", "2")) == _rank_files(_write(made["hf"], tmp_path / "b", "--tp", "2"))


def test_no_config_needs_rules(made: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(made["dcp"], tmp_path / "bare")
    (d / "config.json").unlink()
    with pytest.raises(ManifestError, match="no --rules given, no reshard-rules.yaml and no config.json"):
        open_source(d)
    rules = tmp_path / "rules.yaml"
    rules.write_text('rules:\n  - {pattern: "*.q_proj.weight", kind: column}\n')
    src, manifest = open_source(d, rules=rules)
    assert manifest.source.startswith("rules file") and len(src.tensors) == 25


def test_crafted_metadata_is_refused_and_runs_nothing(made: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(made["dcp"], tmp_path / "crafted")
    proof = tmp_path / "pickle-ran-this"
    (d / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "created-by-reshard")))
    pickle.loads(pickle.dumps(Payload(proof)))  # the payload is live: unpickled, it creates its directory
    assert proof.is_dir()
    with pytest.raises(CheckpointError) as e:
        open_source(d)
    assert "refused: this DCP .metadata asks for os.makedirs" in str(e.value) and "\n" not in str(e.value)
    assert str(d / ".metadata") in str(e.value)
    assert not (tmp_path / "created-by-reshard").exists()
    assert main(["merge", str(d), "-o", str(tmp_path / "out")]) != 0  # the CLI says it in one line, writes nothing
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _rewrite_metadata(d: Path, change: object) -> None:
    """Re-save `.metadata` with torch's own classes after `change(metadata)`."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(d)).read_metadata()
    change(md)  # type: ignore[operator]
    (d / ".metadata").write_bytes(pickle.dumps(md))


def test_transformed_items_are_refused(made: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(made["flat"], tmp_path / "zstd")

    def compress(md: object) -> None:
        info = next(iter(md.storage_data.values()))  # type: ignore[attr-defined]
        info.transform_descriptors = ["stream.zstd/1"]

    _rewrite_metadata(d, compress)
    with pytest.raises(CheckpointError, match=r"was written through stream.zstd/1 .* cannot read transformed ones"):
        open_source(d)


def test_missing_chunk_and_truncated_file_are_refused(made: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(made["flat"], tmp_path / "missing")

    def halve(md: object) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        t = md.state_dict_metadata["model.norm.weight"]  # type: ignore[attr-defined]
        t.size = torch.Size([130])  # the chunk saved now covers half of what it says the tensor is
        assert t.chunks == [ChunkStorageMetadata(torch.Size([0]), torch.Size([65]))]

    _rewrite_metadata(d, halve)
    with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight' of shape \[130\]: its chunks cover 65 of its 130"):
        open_source(d)
    t = _copy(made["flat"], tmp_path / "truncated")
    distcp = next(t.glob("*.distcp"))
    os.truncate(distcp, distcp.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"past the file's end .* the checkpoint is incomplete"):
        open_source(t)


def test_transposed_tensor_is_refused(made: dict[str, Path], tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "t"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # "a" has w's dtype, shape and item length: w is not taken for a copy of a's layout
        dcp.save({"a": torch.zeros(3, 2), "w": torch.arange(6.0).reshape(2, 3).t(), "b": torch.ones(3)},
                 checkpoint_id=str(out))
    with pytest.raises(CheckpointError, match=r"item 'w' .* strides \[1, 3\], not row-major \[2, 1\]"):
        DcpCheckpoint.open(out)


def test_rank_files_torch_reads_and_those_it_cannot(made: dict[str, Path], tmp_path: Path) -> None:
    """torch's HuggingFaceStorageReader reads the rank files' DCP_SHARDING_INFO (global sizes and chunks
    as the tensors' own); a packed kind's tensor (two blocks: not one box) has no entry, and torch's
    reader refuses the directory naming it."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    shards = _write(made["hf"], tmp_path / "tp2", "--tp", "2")
    md = HuggingFaceStorageReader(str(shards)).read_metadata()
    hf = load_file(made["hf"] / "model.safetensors")
    assert {n: list(t.size) for n, t in md.state_dict_metadata.items()} == {n: list(v.shape) for n, v in hf.items()}
    q = md.state_dict_metadata["model.layers.0.self_attn.q_proj.weight"]
    assert sorted((list(c.offsets), list(c.sizes)) for c in q.chunks) == [([0, 0], [32, 65]), ([32, 0], [32, 65])]
    rules = tmp_path / "packed.yaml"
    rules.write_text('rules:\n  - {pattern: "*.mlp.gate_proj.weight", kind: packed_column, blocks: [64, 64]}\n')
    packed = _write(made["hf"], tmp_path / "packed", "--tp", "2", "--rules", str(rules))
    with pytest.raises(KeyError, match="mlp.gate_proj.weight"):
        HuggingFaceStorageReader(str(packed)).read_metadata()

"""Every built-in kind x tp x dtype: written shards and `loader.load` equal torch references, and reassemble.

One small checkpoint per dtype holds a tensor for every kind (and edge cases: 3-D tensors, zero-size,
padding that leaves whole ranks empty, a scalar). Expected pieces come from torch.chunk, explicit
zero-padded tensors and per-block chunk + cat; comparisons are bit for bit (integer views), so
float8 and bfloat16 are checked exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from reshard.format.checkpoint import Checkpoint
from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.write import write_shards
from reshard.plan.planner import make_plan
from reshard.rules.kinds import loader_for
from reshard.rules.manifest import Manifest, Rule
from tests.support.core import (
    assert_same,
    bits,
    even_chunk,
    packed_chunk,
    padded_chunk,
    random_tensor,
    run_cli,
    save_checkpoint,
    sha256_file,
)

pytestmark = pytest.mark.pure

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int64": torch.int64,
}
TPS = [1, 2, 4, 8]

# name -> shape; the rules below give each its kind
SHAPES: dict[str, tuple[int, ...]] = {
    "col.weight": (16, 6),
    "col.bias": (16,),
    "col3d.weight": (8, 3, 2),
    "colpad.weight": (5, 3),  # tp=8: ranks 5..7 get only zeros
    "row.weight": (6, 16),
    "row.bias": (6,),
    "row3d.weight": (2, 8, 3),
    "rowpad.weight": (3, 10),
    "emb.weight": (24, 4),
    "embpad.weight": (13, 4),
    "rep.weight": (5, 3),
    "qkv.weight": (32, 4),  # GQA-like q|k|v block sizes 16|8|8
    "gate_up.weight": (24, 3),  # unequal blocks 8|16
    "empty.weight": (0, 8),
    "norm.weight": (7,),  # no rule: replicated by default
    "scalar": (),  # no rule
}
RULES = [
    {"pattern": "col.*", "kind": "column"},
    {"pattern": "col3d.weight", "kind": "column"},
    {"pattern": "colpad.weight", "kind": "column", "pad": True},
    {"pattern": "row.*", "kind": "row"},
    {"regex": r"row(3d|pad)\.weight", "kind": "row", "pad": True},
    {"pattern": "emb.weight", "kind": "vocab_embed"},
    {"pattern": "embpad.weight", "kind": "vocab_embed", "pad": True},
    {"pattern": "rep.weight", "kind": "replicate"},
    {"pattern": "qkv.weight", "kind": "packed_column", "blocks": [16, 8, 8]},
    {"pattern": "gate_up.weight", "kind": "packed_column", "blocks": [8, 16]},
    {"pattern": "empty.weight", "kind": "row"},
]


def expected_piece(name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank's piece of `name`, computed with torch alone."""
    if name in ("col.weight", "col.bias", "col3d.weight", "emb.weight"):
        return even_chunk(t, tp, rank, 0)
    if name in ("colpad.weight", "embpad.weight"):
        return padded_chunk(t, tp, rank, 0)
    if name in ("row.weight", "empty.weight"):
        return even_chunk(t, tp, rank, 1)
    if name in ("row3d.weight", "rowpad.weight"):
        return padded_chunk(t, tp, rank, 1)
    if name == "qkv.weight":
        return packed_chunk(t, [16, 8, 8], tp, rank)
    if name == "gate_up.weight":
        return packed_chunk(t, [8, 16], tp, rank)
    return t  # row.bias, rep.weight, norm.weight, scalar


def reassemble(name: str, pieces: list[torch.Tensor], tp: int) -> torch.Tensor:
    """The global tensor back from the ranks' pieces (padding dropped)."""
    full = SHAPES[name]
    ints = [bits(p) for p in pieces]
    if name in ("col.weight", "col.bias", "col3d.weight", "emb.weight", "colpad.weight", "embpad.weight"):
        out = torch.cat(ints, 0)
        assert not out[full[0]:].any(), "padding must be zeros"
        return out[: full[0]].view(pieces[0].dtype)
    if name in ("row.weight", "empty.weight", "row3d.weight", "rowpad.weight"):
        out = torch.cat(ints, 1)
        assert not out[:, full[1]:].any(), "padding must be zeros"
        return out[:, : full[1]].view(pieces[0].dtype)
    if name in ("qkv.weight", "gate_up.weight"):
        blocks = [16, 8, 8] if name == "qkv.weight" else [8, 16]
        per_rank = [torch.split(p, [b // tp for b in blocks], 0) for p in ints]
        cols = [torch.cat([per_rank[r][i] for r in range(tp)], 0) for i in range(len(blocks))]
        return torch.cat(cols, 0).view(pieces[0].dtype)
    for p in pieces[1:]:
        assert_same(p, pieces[0], f"{name}: replicated pieces differ")
    return pieces[0]


def make_tensors(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: random_tensor(shape, dtype, gen) for name, shape in SHAPES.items()}


def check_outputs(out: Path, tensors: dict[str, torch.Tensor], tp: int) -> None:
    pieces: dict[str, list[torch.Tensor]] = {name: [] for name in tensors}
    record = json.loads((out / "reshard.json").read_text())
    assert record["tp"] == tp and sorted(record["files"]) == [rank_file_name(r, tp) for r in range(tp)]
    for rank in range(tp):
        path = out / rank_file_name(rank, tp)
        assert record["files"][path.name]["sha256"] == sha256_file(path)
        got = load_file(str(path))
        assert sorted(got) == sorted(tensors)
        for name, t in tensors.items():
            assert_same(got[name], expected_piece(name, t, rank, tp), f"{name} rank {rank}/{tp}")
            pieces[name].append(got[name])
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert (meta["tp"], meta["rank"]) == (str(tp), str(rank))
        described = json.loads(meta["tensors"])
        assert {n: tuple(d["shape"]) for n, d in described.items()} == SHAPES
    for name, t in tensors.items():
        assert_same(reassemble(name, pieces[name], tp), t, f"{name} reassembled")


@pytest.mark.parametrize("tp", TPS, ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_write_shards_equal_torch_reference(tmp_path: Path, dtype: str, tp: int) -> None:
    tensors = make_tensors(DTYPES[dtype])
    ckpt = Checkpoint.open(save_checkpoint(tmp_path / "ckpt", tensors))
    plan = make_plan(ckpt, Manifest.from_dict({"rules": RULES}), tp)
    assert plan.warnings == ()
    write_shards(ckpt, plan, tmp_path / "out", progress=False)
    check_outputs(tmp_path / "out", tensors, tp)


@pytest.mark.parametrize("tp", TPS, ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_loader_load_equals_torch_reference(tmp_path: Path, dtype: str, tp: int) -> None:
    tensors = make_tensors(DTYPES[dtype], seed=1)
    path = save_checkpoint(tmp_path / "ckpt", tensors) / "model.safetensors"
    manifest = Manifest.from_dict({"rules": RULES})
    with safe_open(str(path), "pt") as f:
        for name, t in tensors.items():
            rule = manifest.match(name) or Rule("*", "replicate")
            loader = loader_for(rule, "." + name.rsplit(".", 1)[-1])
            for rank in range(tp):
                got = loader.load(f.get_slice(name), rank, tp)
                want = expected_piece(name, t, rank, tp)
                assert_same(got, want, f"{name} rank {rank}/{tp}")
                assert loader.shard_shape(t.shape, rank, tp) == tuple(want.shape)


@pytest.mark.parametrize("tp", [2, 8], ids=lambda tp: f"tp{tp}")
def test_cli_write_with_rules_file_equals_torch_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tp: int
) -> None:
    tensors = make_tensors(torch.bfloat16, seed=2)
    ckpt = save_checkpoint(tmp_path / "ckpt", tensors)
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"strict": False, "rules": RULES}))
    rc, out, err = run_cli(["write", ckpt, "--tp", tp, "--rules", rules, "-o", tmp_path / "out"], capsys)
    assert (rc, err) == (0, "")
    assert f"wrote {tp} rank files" in out
    check_outputs(tmp_path / "out", tensors, tp)


def test_rules_file_beside_checkpoint_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = make_tensors(torch.float32, seed=3)
    ckpt = save_checkpoint(tmp_path / "ckpt", tensors)
    (ckpt / "reshard-rules.yaml").write_text(yaml.safe_dump({"rules": RULES}))
    rc, out, err = run_cli(["write", ckpt, "--tp", 4, "-o", tmp_path / "out"], capsys)
    assert (rc, err) == (0, "")
    assert f"rules file {ckpt / 'reshard-rules.yaml'}" in out
    check_outputs(tmp_path / "out", tensors, 4)


def test_ranks_subset_writes_only_those_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = make_tensors(torch.float16, seed=4)
    ckpt = save_checkpoint(tmp_path / "ckpt", tensors)
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": RULES}))
    rc, _, err = run_cli(["write", ckpt, "--tp", 4, "--rules", rules, "--ranks", "3,1", "-o", tmp_path / "o"], capsys)
    assert (rc, err) == (0, "")
    names = sorted(p.name for p in (tmp_path / "o").glob("rank-*"))
    assert names == [rank_file_name(1, 4), rank_file_name(3, 4)]
    for rank in (1, 3):
        got = load_file(str(tmp_path / "o" / rank_file_name(rank, 4)))
        for name, t in tensors.items():
            assert_same(got[name], expected_piece(name, t, rank, 4), f"{name} rank {rank}")

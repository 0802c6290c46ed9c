"""The grouped planner (`reshard.plan.planner`) plans exactly what planning each tensor on its own does:
same headers, same offsets, same source byte runs, so the same shard bytes.

Compared (1) with the tensor-by-tensor reference on the test checkpoints of every kind (column, row
with bias, padded vocab, packed, replicate, several files, bf16/f16, rank-shard sources), and (2) on a
20,000-tensor MoE-shaped checkpoint with digests of the plans the previous implementation (commit
27e0a50, before the grouped planner) produced, stored in data/moe_plan_digests.json (made again from the
tensor-by-tensor reference planner when the rank-file header gained DCP_SHARDING_INFO, and again when
it gained the plan identity).

The stream's piece index of a grouped plan (`PlannedTensors.piece_index`: starts in an array, pieces
made when read) is compared with the list `RankStream` builds from the reference plan's tensors, and on
the 20,000-tensor checkpoint with digests of the checkpoint table, the piece index and the shard bytes
from commit 659c47e (before the header fast path and the piece index).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from reshard.io.rank_stream import RankStream
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.testing.moe import moe_checkpoint
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.plan_reference import _extent, plan_digest, reference_plan

pytestmark = pytest.mark.pure

DIGESTS = json.loads((Path(__file__).parent / "data" / "moe_plan_digests.json").read_text())

MIXED_RULES = """rules:
  - {pattern: "*.col.weight", kind: column}
  - {pattern: "*.row.weight", kind: row}
  - {pattern: "*.row.bias", kind: row}
  - {pattern: "*.emb.weight", kind: vocab_embed, pad: true}
  - {pattern: "*.qkv.weight", kind: packed_column, blocks: [16, 8, 8]}
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("groups")
    g = torch.Generator().manual_seed(0)
    d = root / "mixed"
    d.mkdir()
    tensors = {}
    for layer in range(6):  # groups of equal shape and rule, a few odd ones out
        p = f"l.{layer}"
        tensors.update({
            f"{p}.col.weight": torch.randn(24, 20, generator=g), f"{p}.row.weight": torch.randn(13, 40, generator=g).bfloat16(),
            f"{p}.row.bias": torch.randn(13, generator=g), f"{p}.qkv.weight": torch.randn(32, 4, generator=g).half(),
            f"{p}.norm.weight": torch.randn(20, generator=g).half(),
        })
    tensors["m.emb.weight"] = torch.randn(37, 8, generator=g)
    tensors["m.scalar"] = torch.tensor(3.0)
    save_file(dict(list(tensors.items())[:15]), d / "a.safetensors")
    save_file(dict(list(tensors.items())[15:]), d / "b.safetensors")
    (d / "reshard-rules.yaml").write_text(MIXED_RULES)
    llama = make_checkpoint(root / "llama", llama_config(vocab_size=250, num_key_value_heads=4), num_files=2)
    phi3 = make_checkpoint(root / "phi3", llama_config(model_type="phi3", num_key_value_heads=4))
    source, manifest = open_source(d)
    write_shards(source, make_plan(source, manifest, 4), root / "mixed-tp4", progress=False)
    odd = root / "odd"  # names JSON escapes (quote, backslash, non-ASCII), a colon, an empty tensor
    odd.mkdir()
    save_file({'l.0."q".col.weight': torch.randn(8, 4, generator=g), "l.1.\\é.col.weight": torch.randn(8, 4, generator=g),
               "l.2:x.col.weight": torch.randn(8, 4, generator=g), "l.3.row.weight": torch.randn(4, 8, generator=g).half(),
               "empty.weight": torch.zeros(0, 4)}, odd / "model.safetensors")
    (odd / "reshard-rules.yaml").write_text(MIXED_RULES)
    empty = root / "empty"  # no tensor at all
    empty.mkdir()
    save_file({}, empty / "model.safetensors")
    (empty / "reshard-rules.yaml").write_text(MIXED_RULES)
    return {"mixed": d, "llama": llama, "phi3": phi3, "shards": root / "mixed-tp4", "odd": odd, "empty": empty}


@pytest.mark.parametrize("name", ["mixed", "llama", "phi3", "shards", "odd", "empty"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_grouped_plan_equals_tensor_by_tensor_plan(sources: dict[str, Path], name: str, tp: int) -> None:
    ckpt, manifest = open_source(sources[name])
    plan = make_plan(ckpt, manifest, tp)
    ref = reference_plan(ckpt, manifest, tp)
    for got, want in zip(plan.ranks, ref, strict=True):
        assert got.header == want.header
        assert got.size == want.size and got.stats() == want.stats()
        assert tuple(got.tensors) == want.tensors  # names, selections, offsets, every source run
    assert plan_digest(plan.ranks) == plan_digest(ref)
    lazy = make_plan(ckpt, manifest, tp, lazy=True)
    assert [rp.header for rp in lazy.ranks] == [rp.header for rp in plan.ranks]


def test_grouped_plan_streams_the_same_bytes(sources: dict[str, Path]) -> None:
    ckpt, manifest = open_source(sources["mixed"])
    for got, want in zip(make_plan(ckpt, manifest, 4).ranks, reference_plan(ckpt, manifest, 4), strict=True):
        with RankStream(got) as a, RankStream(want) as b:
            assert b"".join(a.chunks()) == b"".join(b.chunks())


@pytest.mark.parametrize("tp", sorted(DIGESTS["digests"], key=int))
def test_moe_plan_is_byte_identical_to_the_previous_implementation(tmp_path_factory: pytest.TempPathFactory,
                                                                    tp: str) -> None:
    spec = DIGESTS["checkpoint"]
    path = moe_checkpoint(tmp_path_factory.getbasetemp() / "moe20k", tensors=spec["tensors"], num_files=spec["num_files"])
    ckpt, manifest = open_source(path)
    plan = make_plan(ckpt, manifest, int(tp))
    assert len(plan.ranks[0].tensors) == spec["tensors"]
    assert plan_digest(plan.ranks) == DIGESTS["digests"][tp]


def stream_index(stream: RankStream) -> list[tuple[int, Any]]:
    """(start, piece) of every piece of a stream's index, the header as "header"."""
    return [(start, "header" if isinstance(piece, bytes) else piece) for start, piece in zip(stream._starts, stream._pieces)]


@pytest.mark.parametrize("name", ["mixed", "llama", "phi3", "shards", "odd", "empty"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_piece_index_equals_the_one_built_from_the_tensors(sources: dict[str, Path], name: str, tp: int) -> None:
    ckpt, manifest = open_source(sources[name])
    for got, want in zip(make_plan(ckpt, manifest, tp).ranks, reference_plan(ckpt, manifest, tp), strict=True):
        assert not hasattr(want.tensors, "piece_index")  # the reference: RankStream's own list of the tensors' extents
        with RankStream(got) as a, RankStream(want) as b:
            assert stream_index(a) == stream_index(b) and len(a._pieces) == len(b._pieces)
            assert a._pieces[0] is got.header
            n = len(a._pieces)  # indexing like a list: negative, slices, past the end
            assert [a._pieces[-1], a._pieces[1:3], a._pieces[::-1][:2]] == [b._pieces[-1], b._pieces[1:3], b._pieces[::-1][:2]]
            with pytest.raises(IndexError):
                a._pieces[n]
            assert b"".join(a.chunks(3, got.size - 1)) == b"".join(b.chunks(3, want.size - 1))
        with RankStream(got) as c:  # built once per plan, shared by its streams
            assert c._starts is a._starts


def test_moe_stream_is_byte_identical_to_the_previous_implementation(tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = DIGESTS["checkpoint"]
    path = moe_checkpoint(tmp_path_factory.getbasetemp() / "moe20k", tensors=spec["tensors"], num_files=spec["num_files"])
    ckpt, manifest = open_source(path)
    table = hashlib.sha256()
    for name, t in ckpt.tensors.items():
        table.update(repr((name, t.dtype, t.shape, t.file.name, t.start, t.nbytes)).encode())
    assert table.hexdigest() == DIGESTS["table"]
    for key, want in DIGESTS["streams"].items():
        tp, rank = map(int, key.split("/"))
        rp = make_plan(ckpt, manifest, tp, ranks=[rank]).ranks[0]
        with RankStream(rp) as s:
            index = hashlib.sha256()
            for start, piece in stream_index(s):
                index.update(repr((start, piece if piece == "header" else _extent(piece))).encode())
            data = hashlib.sha256()
            for chunk in s.chunks():
                data.update(chunk)
        assert {"index": index.hexdigest(), "sha256": data.hexdigest()} == want, key

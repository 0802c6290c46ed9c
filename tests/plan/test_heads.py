"""Head-aware splits: GQA fused qkv (packed_column with heads) and kv-head replication (column with heads).

With heads >= tp the heads are chunked; with heads < tp (GQA kv heads) each head goes to tp/heads
consecutive ranks. The reference repeats every head tp/heads times with torch.repeat_interleave and
then chunks, which is what a TP attention layer expects to find on each rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import PlanError
from reshard.format.checkpoint import Checkpoint
from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.write import write_shards
from reshard.plan.planner import make_plan
from reshard.rules.manifest import Manifest
from tests.support.core import assert_same, bits, head_chunk, packed_chunk, random_tensor, save_checkpoint

pytestmark = pytest.mark.pure

NQ, NKV, HD, HIDDEN = 8, 2, 3, 4


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor], rules: list[dict], tp: int) -> list[dict]:
    ckpt = Checkpoint.open(save_checkpoint(tmp_path / "ckpt", tensors))
    plan = make_plan(ckpt, Manifest.from_dict({"rules": rules}), tp)
    write_shards(ckpt, plan, tmp_path / "out", progress=False)
    return [load_file(str(tmp_path / "out" / rank_file_name(r, tp))) for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8], ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_gqa_fused_qkv(tmp_path: Path, tp: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(tp)
    qkv = random_tensor(((NQ + 2 * NKV) * HD, HIDDEN), dtype, gen)
    blocks = [NQ * HD, NKV * HD, NKV * HD]
    rule = {"pattern": "*.qkv_proj.weight", "kind": "packed_column", "blocks": blocks, "heads": [NQ, NKV, NKV],
            "replicate_heads": [False, True, True]}
    name = "model.layers.0.self_attn.qkv_proj.weight"
    ranks = _write(tmp_path, {name: qkv}, [rule], tp)
    q, k, v = torch.split(qkv, blocks, 0)
    for rank, got in enumerate(ranks):
        piece = got[name]
        # written piece = this rank's q heads | its k head(s) | its v head(s)
        q_heads = NQ // tp
        kv_rows = HD * max(1, NKV // tp)
        assert tuple(piece.shape) == (q_heads * HD + 2 * kv_rows, HIDDEN)
        gq, gk, gv = torch.split(piece, [q_heads * HD, kv_rows, kv_rows], 0)
        assert_same(gq, torch.chunk(q, tp, 0)[rank], f"q rank {rank}")
        kv_head = rank * NKV // tp  # the kv head rank `rank` serves when NKV < tp
        if NKV >= tp:
            assert_same(gk, torch.chunk(k, tp, 0)[rank], f"k rank {rank}")
            assert_same(gv, torch.chunk(v, tp, 0)[rank], f"v rank {rank}")
        else:
            assert_same(gk, k[kv_head * HD : (kv_head + 1) * HD], f"k rank {rank}")
            assert_same(gv, v[kv_head * HD : (kv_head + 1) * HD], f"v rank {rank}")
        assert_same(piece, packed_chunk(qkv, blocks, tp, rank, [NQ, NKV, NKV]), f"qkv rank {rank}")
    # q rows reassemble exactly; each kv head is held by max(1, tp/NKV) ranks, found by value
    kv_rows = HD * max(1, NKV // tp)
    q_pieces = [torch.split(p[name], [NQ * HD // tp, 2 * kv_rows], 0)[0] for p in ranks]
    assert_same(torch.cat([bits(x) for x in q_pieces]).view(dtype), q)
    k_heads = [bits(h) for h in torch.split(k, HD, 0)]
    holders = {h: 0 for h in range(NKV)}
    for p in ranks:
        gk = bits(torch.split(p[name], [NQ * HD // tp, kv_rows, kv_rows], 0)[1])
        for h in range(NKV):
            holders[h] += any(torch.equal(x, k_heads[h]) for x in torch.split(gk, HD, 0))
    assert holders == dict.fromkeys(range(NKV), max(1, tp // NKV))


@pytest.mark.parametrize("tp", [2, 4, 8], ids=lambda tp: f"tp{tp}")
def test_kv_heads_replicated_to_consecutive_ranks(tmp_path: Path, tp: int) -> None:
    """column with heads=2, replicate_heads: at tp=4 and 8 each kv head lands on tp/2 consecutive ranks."""
    gen = torch.Generator().manual_seed(10 + tp)
    k_w = random_tensor((2 * HD, HIDDEN), torch.float16, gen)
    k_b = random_tensor((2 * HD,), torch.float16, gen)
    rules = [{"pattern": "*.k_proj.*", "kind": "column", "heads": 2, "replicate_heads": True}]
    names = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias")
    ranks = _write(tmp_path, dict(zip(names, (k_w, k_b), strict=True)), rules, tp)
    per_head = tp // 2
    for rank, got in enumerate(ranks):
        head = rank // per_head
        assert_same(got[names[0]], k_w[head * HD : (head + 1) * HD], f"weight rank {rank}")
        assert_same(got[names[1]], k_b[head * HD : (head + 1) * HD], f"bias rank {rank}")
        assert_same(got[names[0]], head_chunk(k_w, 2, tp, rank))
    # the first tp/2 ranks hold head 0 and the rest head 1: bit-identical groups
    groups = [torch.stack([bits(ranks[r][names[0]]) for r in range(g * per_head, (g + 1) * per_head)])
              for g in range(2)]
    for g in groups:
        assert bool((g == g[0]).all())
    assert not torch.equal(groups[0][0], groups[1][0])


def test_heads_not_dividing_tp_is_an_error_with_exact_message(tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    ckpt = Checkpoint.open(save_checkpoint(tmp_path / "ckpt", {name: torch.zeros(9, 4)}))
    rule = {"pattern": "*.k_proj.weight", "kind": "column", "heads": 3, "replicate_heads": True}
    manifest = Manifest.from_dict({"rules": [rule]})
    with pytest.raises(PlanError) as e:
        make_plan(ckpt, manifest, 2)
    assert str(e.value) == (
        "model.layers.0.self_attn.k_proj.weight: dim 0: 3 heads cannot be shared by tp=2 "
        "(neither divides the other); pick a tp that plans this checkpoint: 1, 3, 6, 9, 12, 15, 18, 21, 24, 27, ... "
        "(rule '*.k_proj.weight', kind column)"
    )
    # the listed ones are the first ten that divide 3 or that 3 divides: each plans
    assert [t for t in range(1, 65) if 3 % t == 0 or t % 3 == 0][:10] == [1, 3, 6, 9, 12, 15, 18, 21, 24, 27]
    # tp=3 and tp=6 fit three heads; tp=1 always does
    for tp in (1, 3, 6):
        assert make_plan(ckpt, manifest, tp).tp == tp


def test_fewer_heads_than_tp_without_replicate_heads_is_an_error(tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    ckpt = Checkpoint.open(save_checkpoint(tmp_path / "ckpt", {name: torch.zeros(6, 4)}))
    manifest = Manifest.from_dict({"rules": [{"pattern": "*.k_proj.weight", "kind": "column", "heads": 2}]})
    with pytest.raises(PlanError) as e:
        make_plan(ckpt, manifest, 4)
    assert str(e.value) == (
        "model.layers.0.self_attn.k_proj.weight: dim 0: 2 heads are not divisible by tp=4; "
        "pick a tp that plans this checkpoint: 1, 2 (rule '*.k_proj.weight', kind column)"
    )


def test_packed_heads_not_dividing_tp_names_the_block(tmp_path: Path) -> None:
    name = "qkv.weight"
    ckpt = Checkpoint.open(save_checkpoint(tmp_path / "ckpt", {name: torch.zeros(24, 2)}))
    rule = {"pattern": name, "kind": "packed_column", "blocks": [12, 6, 6], "heads": [4, 3, 3],
            "replicate_heads": [False, True, True]}
    with pytest.raises(PlanError) as e:
        make_plan(ckpt, Manifest.from_dict({"rules": [rule]}), 2)
    assert str(e.value) == (
        "qkv.weight: packed block 1 (size 6): 3 heads cannot be shared by tp=2 "
        "(neither divides the other); pick a tp that plans this checkpoint: 1 "
        "(rule 'qkv.weight', kind packed_column)"
    )


def test_dim_not_a_multiple_of_heads(tmp_path: Path) -> None:
    ckpt = Checkpoint.open(save_checkpoint(tmp_path / "ckpt", {"k.weight": torch.zeros(6, 2)}))
    manifest = Manifest.from_dict({"rules": [{"pattern": "k.weight", "kind": "column", "heads": 4}]})
    with pytest.raises(PlanError, match=r"^k\.weight: dim 0 has size 6, not a multiple of heads=4 "):
        make_plan(ckpt, manifest, 2)

"""A directory of rank shards as a source: resharding tp=P -> tp=Q and merging, byte for byte.

Row-split tensors read back from several rank files become interleaved rows; the stream must give
exactly the bytes of a write from the full checkpoint, from any offset and in any chunk size.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.io.rank_stream import RankStream
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.plan.reads import Interleave

pytestmark = pytest.mark.pure

RULES = """rules:
  - {pattern: "*.col.weight", kind: column}
  - {pattern: "*.row.weight", kind: row}
  - {pattern: "*.row.bias", kind: row}
  - {pattern: "*.emb.weight", kind: vocab_embed, pad: true}
"""


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "m.col.weight": torch.randn(24, 20, generator=g),
        "m.row.weight": torch.randn(13, 40, generator=g).to(torch.bfloat16),
        "m.row.bias": torch.randn(13, generator=g),
        "m.emb.weight": torch.randn(37, 8, generator=g),
        "m.norm.weight": torch.randn(20, generator=g).half(),
    }
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(tensors, d / "model.safetensors")
    (d / "rules.yaml").write_text(RULES)
    return d


def _write(src: Path, tp: int, out: Path, rules: Path | None = None) -> Path:
    source, manifest = open_source(src, rules=rules)
    write_shards(source, make_plan(source, manifest, tp), out, progress=False)
    return out


@pytest.mark.parametrize(("p", "q"), [(4, 2), (2, 4), (4, 1), (8, 4), (1, 2)])
def test_reshard_from_shards_is_byte_identical(ckpt: Path, tmp_path: Path, p: int, q: int) -> None:
    rules = ckpt / "rules.yaml"
    shards = _write(ckpt, p, tmp_path / f"tp{p}", rules)
    direct = _write(ckpt, q, tmp_path / f"direct{q}", rules)
    via = _write(shards, q, tmp_path / f"via{q}")
    for r in range(q):
        name = f"rank-{r:05d}-of-{q:05d}.safetensors"
        assert (via / name).read_bytes() == (direct / name).read_bytes(), name


def test_interleaved_rows_stream_from_any_offset(ckpt: Path, tmp_path: Path) -> None:
    shards = _write(ckpt, 4, tmp_path / "tp4", ckpt / "rules.yaml")
    direct = _write(ckpt, 2, tmp_path / "direct2", ckpt / "rules.yaml")
    source, manifest = open_source(shards)
    plan = make_plan(source, manifest, 2)
    row = next(t for t in plan.ranks[0].tensors if t.name == "m.row.weight")
    assert any(isinstance(s, Interleave) for s in row.segments), row.segments  # rows from two rank files
    rng = random.Random(0)
    for rp in plan.ranks:
        want = (direct / f"rank-{rp.rank:05d}-of-00002.safetensors").read_bytes()
        for chunk in (7, 64, 1000):
            with RankStream(rp, chunk_size=chunk) as s:
                for _ in range(20):
                    a = rng.randrange(rp.size)
                    b = rng.randrange(a, rp.size + 1)
                    assert b"".join(bytes(c) for c in s.chunks(a, b)) == want[a:b], (rp.rank, chunk, a, b)


def test_merge_gives_back_the_original(ckpt: Path, tmp_path: Path) -> None:
    original = load_file(ckpt / "model.safetensors")
    for tp in (1, 2, 4, 8):
        shards = _write(ckpt, tp, tmp_path / f"tp{tp}", ckpt / "rules.yaml")
        merge(shards, tmp_path / f"merged{tp}", progress=False)
        got = load_file(tmp_path / f"merged{tp}" / "model.safetensors")
        assert set(got) == set(original)
        for k, v in original.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), (tp, k)

"""Boxes planned as a rank is (`reshard.plan.box_plan`): the answer's tensors equal torch slicing of the full
tensors (read back with safetensors) from a checkpoint and from rank files of other layouts; only the
files and bytes the boxes cover are read; bad boxes are refused with one error naming each, nothing planned."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file

from reshard.errors import BoxError, HeaderError
from reshard.fill.box_fill import read_boxes
from reshard.format.box_request import Box, box_keys, decode_box_metadata
from reshard.format.checkpoint import Checkpoint, parse_header
from reshard.io.rank_stream import RankStream
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source, open_tensors
from reshard.layout.mesh import Layout
from reshard.plan.box_plan import plan_boxes, runs_bound
from reshard.plan.planner import make_plan
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.box_refs import full_tensors, random_boxes, sliced

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bfloat16, three files + index.json, vocab 250 (odd at tp=4)."""
    return make_checkpoint(tmp_path_factory.mktemp("boxes") / "llama", llama_config(vocab_size=250),
                           dtype=torch.bfloat16, num_files=3, seed=3)


def _answer(source: object, boxes: list[Box]) -> dict[str, torch.Tensor]:
    plan = plan_boxes(source, boxes)  # type: ignore[arg-type]
    with RankStream(plan) as stream:
        return load(b"".join(bytes(c) for c in stream.chunks()))


def test_random_boxes_of_a_checkpoint_equal_torch_slicing(ckpt: Path) -> None:
    full = full_tensors(ckpt)
    boxes = random_boxes(full, 200, seed=0) + [Box.whole(n, full[n].shape) for n in sorted(full)[:3]]
    got = _answer(Checkpoint.open(ckpt), boxes)
    assert set(got) == set(box_keys(boxes))
    for box, key in zip(boxes, box_keys(boxes)):
        assert got[key].dtype == torch.bfloat16
        assert torch.equal(got[key], sliced(full[box.name], box)), key
    assert any(0 in b.sizes for b in boxes)  # empty boxes are answered as empty tensors


@pytest.mark.parametrize("layout", [Layout(tp=4), Layout(tp=2, fsdp=2)], ids=["tp4", "fsdp2xtp2"])
def test_boxes_of_rank_files_equal_the_original_tensors(ckpt: Path, tmp_path: Path, layout: Layout) -> None:
    """Rank files of another layout are a source like any other: a box across their pieces (rows of one
    rank and columns of another, the vocab padding cut at tp=4) reads the pieces that hold it."""
    source, manifest = open_source(ckpt)
    write_shards(source, make_plan(source, manifest, layout), tmp_path / "ranks", progress=False)
    shards = open_tensors(tmp_path / "ranks")
    full = full_tensors(ckpt)
    boxes = random_boxes(full, 120, seed=1)
    got = _answer(shards, boxes)
    for box, key in zip(boxes, box_keys(boxes)):
        assert torch.equal(got[key], sliced(full[box.name], box)), key
    assert [t.shape for t in read_boxes(tmp_path / "ranks", boxes[:5])] == [torch.Size(b.sizes) for b in boxes[:5]]


def test_the_answer_describes_each_box_and_reads_only_its_files(ckpt: Path) -> None:
    source = Checkpoint.open(ckpt)
    name = "model.embed_tokens.weight"
    shape = source.tensors[name].shape
    boxes = [Box(name, (10, 0), (20, shape[1])), Box(name, (0, 8), (shape[0], 4)), Box("model.norm.weight", (0,), (3,))]
    plan = plan_boxes(source, boxes)
    with RankStream(plan) as stream:
        raw = b"".join(bytes(c) for c in stream.chunks())
    entries, meta = parse_header(raw[: 8 + int.from_bytes(raw[:8], "little")], path="answer", file_size=len(raw))
    described = decode_box_metadata(meta, source="answer")
    keys = [f"{name}[10:30,0:{shape[1]}]", f"{name}[0:{shape[0]},8:12]", "model.norm.weight"]
    assert box_keys(boxes) == keys
    assert {k: described[k] for k in keys} == {k: (b, source.tensors[b.name].shape) for k, b in zip(keys, boxes)}
    assert {tuple(entries[k]["shape"]) for k in keys} == {b.sizes for b in boxes}
    holding = {str(source.tensors[b.name].file) for b in boxes}
    assert set(plan.files) == holding < {str(f.path) for f in source.files}
    # whole rows of a row-major tensor are one run: exactly their bytes are read
    rows = plan_boxes(source, boxes[:1])
    assert rows.stats()["bytes_read"] == 20 * shape[1] * 2 == rows.stats()["bytes"] - len(rows.header)
    with safe_open(str(source.tensors[name].file), "pt") as f:
        assert torch.equal(load(raw)[keys[1]], f.get_slice(name)[:, 8:12])
    with pytest.raises(HeaderError, match="not an answer to a boxes request"):
        decode_box_metadata({"format": "reshard.rank/1"}, source="x")


def test_bad_boxes_are_refused_naming_each(ckpt: Path) -> None:
    source = Checkpoint.open(ckpt)
    name, shape = "model.embed_tokens.weight", source.tensors["model.embed_tokens.weight"].shape
    cases = [
        ([Box("nope", (0,), (1,)), Box("nada", (0,), (1,))], ["no tensor named 'nada', 'nope'"]),
        ([Box(name, (-1, 0), (1, 1))], ["must not be negative"]),
        ([Box(name, (shape[0] - 1, 0), (2, 1))], [f"dim 0 ends at {shape[0] + 1}", f"past its size {shape[0]}"]),
        ([Box(name, (0,), (1,))], ["1 offsets and 1 sizes for a 2-d tensor"]),
        ([Box(name, (0, 0), (1, 1))] * 2, ["asked for more than once"]),
        ([Box(name, (0.5, 0), (1, 1))], ["must be integers"]),  # type: ignore[arg-type]
    ]
    for boxes, fragments in cases:
        with pytest.raises(BoxError) as e:
            plan_boxes(source, boxes, where="ckpt")
        assert str(e.value).startswith("ckpt: ") and "\n" not in str(e.value)
        for fragment in fragments:
            assert fragment in str(e.value), (fragment, str(e.value))


def test_the_work_a_request_causes_is_bounded(ckpt: Path) -> None:
    source = Checkpoint.open(ckpt)
    name, shape = "model.embed_tokens.weight", source.tensors["model.embed_tokens.weight"].shape
    whole = Box.whole(name, shape)
    nbytes = shape[0] * shape[1] * 2
    assert plan_boxes(source, [whole], max_bytes=nbytes).size > nbytes
    with pytest.raises(BoxError, match=f"{nbytes} bytes in all, over the {nbytes - 1} bytes"):
        plan_boxes(source, [whole], max_bytes=nbytes - 1)
    # a column of a matrix is one strided run; single elements of a 3-d tensor's rows are a run per row
    gt = source.global_tensors()[name]
    assert runs_bound(gt, Box(name, (0, 5), (shape[0], 1))) == 1
    assert runs_bound(gt, whole) == 1
    with pytest.raises(BoxError, match="up to 2 separate runs of source bytes, over the 1"):
        plan_boxes(source, [Box(name, (0, 5), (shape[0], 1)), Box(name, (0, 6), (shape[0], 1))], max_runs=1)


def test_runs_bound_covers_what_is_planned(tmp_path: Path) -> None:
    """The bound is checked before any extent is made; it is never below what `segments_for` makes."""
    path = tmp_path / "c"
    path.mkdir()
    from safetensors.torch import save_file

    save_file({"e": torch.arange(6 * 5 * 4 * 3, dtype=torch.float32).reshape(6, 5, 4, 3)}, str(path / "model.safetensors"))
    source = Checkpoint.open(path)
    gt = source.global_tensors()["e"]
    rng = random.Random(5)
    for _ in range(200):
        offsets = tuple(rng.randrange(0, n) for n in gt.shape)
        box = Box("e", offsets, tuple(rng.randrange(1, n - o + 1) for o, n in zip(offsets, gt.shape)))
        plan = plan_boxes(source, [box])
        assert len(plan.tensors[0].segments) <= runs_bound(gt, box), box
        assert torch.equal(_answer(source, [box])["e"], sliced(load_file(path / "model.safetensors")["e"], box))

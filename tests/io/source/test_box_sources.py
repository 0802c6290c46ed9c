"""Boxes from a checkpoint in a real S3 server (moto) and on a static HTTP server, planned here: the same
tensors as torch slicing of the local files, and only about the bytes the boxes cover fetched."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from reshard.fill.box_fill import read_boxes
from reshard.format.box_request import Box
from reshard.io.client.box_client import PlannedBody
from reshard.io.source.opener import open_tensors
from reshard.plan.box_plan import plan_boxes
from tests.support.box_refs import full_tensors, sliced

pytestmark = pytest.mark.servers


@pytest.fixture(params=["s3", "http"])
def store(request: pytest.FixtureRequest, s3: object, web: object, s3_env: object) -> tuple[object, str]:
    if request.param == "s3":
        return s3, "s3://ckpts/models/llama"
    return web, f"{web.url}/files/llama/"  # type: ignore[attr-defined]


def test_boxes_from_a_store_equal_local_slicing_and_fetch_what_they_cover(store: tuple[object, str],
                                                                          local_root: Path) -> None:
    srv, url = store
    full = full_tensors(local_root / "llama")
    rng = random.Random(2)
    # row blocks (contiguous) and column blocks (strided) of the large tensors
    boxes = []
    for name in rng.sample([n for n in sorted(full) if full[n].ndim == 2], 6):
        rows, cols = full[name].shape
        a = rng.randrange(0, rows // 2)
        boxes.append(Box(name, (a, 0), (rows // 4, cols)))
        c = rng.randrange(0, cols // 2)
        boxes.append(Box(name, (0, c), (rows, cols // 2)))
    srv.reset()  # type: ignore[attr-defined]
    source = open_tensors(url)
    opened = srv.reset()["bytes"]  # type: ignore[attr-defined]  # headers, index.json, config.json
    got = read_boxes(url, boxes)
    fetched = srv.reset()  # type: ignore[attr-defined]
    for box, t in zip(boxes, got):
        assert torch.equal(t, sliced(full[box.name], box)), box
    plan = plan_boxes(source, boxes)
    covered = sum(s.nbytes for t in plan.tensors for s in t.segments if s.file)
    total = sum(f.size for f in source.files)
    # the source opened again (read_boxes opens it), then the boxes' bytes as the plan reads them
    assert covered <= fetched["bytes"] - opened <= plan.stats()["bytes_read"] * 1.05, (fetched, opened, covered)
    assert plan.stats()["bytes_read"] < total / 2


def test_a_planned_body_is_the_answer_the_service_would_send(local_root: Path) -> None:
    boxes = [Box("model.embed_tokens.weight", (3, 5), (20, 7)), Box("model.norm.weight", (0,), (10,))]
    body = PlannedBody(local_root / "llama", boxes)
    try:
        data = bytearray(body.size)
        body.readinto(memoryview(data))
        assert body.expected_sha256() is None and body.verify is False
    finally:
        body.close()
    from reshard.io.rank_stream import RankStream

    with RankStream(plan_boxes(open_tensors(local_root / "llama"), boxes)) as stream:
        assert bytes(data) == b"".join(bytes(c) for c in stream.chunks())

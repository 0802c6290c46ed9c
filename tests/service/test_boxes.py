"""`POST /v1/checkpoints/{name}/boxes` against a real `reshard serve`: blocks of tensors from an HF checkpoint
and from rank files, equal to torch slicing of the full tensors (read with safetensors); the shards'
guarantees (Content-Length, a strong ETag, Range/If-Range resumption, the sha256, the token); and bad input
(negative offsets, boxes past a tensor's end, unknown names, 10^6 boxes, malformed JSON, too many bytes or
runs) answered 4xx JSON with nothing read or streamed for it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load, load_file, save_file

from reshard.errors import BoxError, IntegrityError
from reshard.fill.box_fill import read_boxes
from reshard.format.box_request import Box, box_keys
from reshard.format.checkpoint import Checkpoint
from reshard.io.client.box_client import BoxBody
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.layout.mesh import Layout
from reshard.plan.box_plan import runs_bound
from reshard.plan.planner import make_plan
from tests.support.box_refs import full_tensors, random_boxes, sliced
from tests.support.live import LiveServer, live_server, make_ckpt, metric, streams_settled

pytestmark = pytest.mark.servers

TOKEN = "boxes-t0ken"
# the checkpoint is 228 KB: all of it is over max_box_bytes; a column of `cube` is a run per row
LIMITS = {"max_boxes": 1000, "max_box_bytes": 200_000, "max_box_runs": 300, "chunk_size": 64 << 10}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    """ROOT/llama (bfloat16, 2 files), ROOT/llama-ranks (its rank files at fsdp=2 x tp=2), ROOT/cube (one
    [400, 3, 4] tensor), served with a token."""
    root = tmp_path_factory.mktemp("boxes") / "root"
    (root / "cube").mkdir(parents=True)
    save_file({"cube": torch.arange(4800, dtype=torch.float32).reshape(400, 3, 4)}, str(root / "cube" / "model.safetensors"))
    make_ckpt(root / "llama", dtype=torch.bfloat16, num_files=2, vocab_size=250, num_key_value_heads=4, seed=7)
    source, manifest = open_source(root / "llama")
    write_shards(source, make_plan(source, manifest, Layout(tp=2, fsdp=2)), root / "llama-ranks", progress=False)
    with live_server(root, token=TOKEN, log_dir=root.parent, **LIMITS) as srv:
        yield srv, root
        assert srv.alive(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()


def _post(srv: LiveServer, name: str, body: Any, *, path: str = "boxes", **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**srv.headers(), "Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{srv.ckpt_url(name)}/{path}", content=content, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("name", ["llama", "llama-ranks"])
def test_boxes_over_http_equal_torch_slicing(served: tuple[LiveServer, Path], name: str) -> None:
    srv, root = served
    full = full_tensors(root / "llama")
    boxes = random_boxes(full, 12, len(name), empty=False) + [Box("model.embed_tokens.weight", (0, 0), (250, 64)),
                                                 Box("model.embed_tokens.weight", (249, 3), (1, 61))]
    got = read_boxes(srv.ckpt_url(name), boxes, token=TOKEN)
    for box, t in zip(boxes, got):
        assert t.dtype == torch.bfloat16 and torch.equal(t, sliced(full[box.name], box)), box
    cast = [torch.empty(b.sizes, dtype=torch.float32) for b in boxes]
    read_boxes(srv.ckpt_url(name), boxes, out=cast, token=TOKEN)
    assert all(torch.equal(c, sliced(full[b.name], b).float()) for b, c in zip(boxes, cast))


def test_the_answer_has_the_shards_guarantees(served: tuple[LiveServer, Path]) -> None:
    srv, root = served
    full = full_tensors(root / "llama")
    boxes = random_boxes(full, 6, 11, empty=False)
    request = {"boxes": [b.to_json() for b in boxes]}
    first = _post(srv, "llama", request)
    assert first.status_code == 200, first.text
    body = first.content
    assert int(first.headers["content-length"]) == len(body)
    assert first.headers["accept-ranges"] == "bytes" and re.fullmatch(r'"[0-9a-f]{40}-b"', first.headers["etag"])
    got = load(body)
    assert all(torch.equal(got[k], sliced(full[b.name], b)) for b, k in zip(boxes, box_keys(boxes)))
    again = _post(srv, "llama", request)  # the first whole body filled the digest cache
    assert again.content == body and again.headers["etag"] == first.headers["etag"]
    assert again.headers["x-reshard-sha256"] == hashlib.sha256(body).hexdigest()
    digest = _post(srv, "llama", request, path="boxes/digest").json()
    assert digest == {"boxes": 6, "size": len(body), "etag": first.headers["etag"],
                      "sha256": hashlib.sha256(body).hexdigest(), "cached": True}
    other = _post(srv, "llama", {"boxes": request["boxes"][::-1]})  # another request: another ETag
    assert other.headers["etag"] != first.headers["etag"]
    # resuming: Range with the ETag answers the rest; with a stale ETag, the whole answer
    tail = _post(srv, "llama", request, headers={"Range": "bytes=100-", "If-Range": first.headers["etag"]})
    assert tail.status_code == 206 and tail.content == body[100:]
    assert tail.headers["content-range"] == f"bytes 100-{len(body) - 1}/{len(body)}"
    stale = _post(srv, "llama", request, headers={"Range": "bytes=100-", "If-Range": '"0000-b"'})
    assert stale.status_code == 200 and stale.content == body
    past = _post(srv, "llama", request, headers={"Range": f"bytes={len(body)}-"})
    assert past.status_code == 416 and past.json()["error"] == "RangeNotSatisfiable"
    refused = httpx.post(f"{srv.ckpt_url('llama')}/boxes", json=request, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"] == "Unauthorized"


def test_a_broken_transfer_resumes(served: tuple[LiveServer, Path], cutting_proxy: Any) -> None:
    srv, root = served
    full = full_tensors(root / "llama")
    boxes = [Box.whole(n, full[n].shape) for n in sorted(full)[:8]]
    port = int(srv.url.rsplit(":", 1)[1])
    with cutting_proxy(("127.0.0.1", port), cut_after=20_000, cuts=3) as proxy:
        got = read_boxes(f"{proxy.url}/v1/checkpoints/llama", boxes, token=TOKEN)
        ranges = [int(m.group(1)) for r in proxy.requests if (m := re.search(rb"range: bytes=(\d+)-", r, re.I))]
    assert all(torch.equal(t, full[b.name]) for b, t in zip(boxes, got))
    assert len(ranges) == 3 and ranges == sorted(ranges) and ranges[0] > 0


def test_an_answer_that_changed_is_refused(served: tuple[LiveServer, Path], cutting_proxy: Any) -> None:
    srv, root = served
    weights = sorted((root / "llama").glob("*.safetensors"))

    def touch() -> None:  # a new mtime: a new source identity, so a new ETag
        for w in weights:
            st = w.stat()
            os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    port = int(srv.url.rsplit(":", 1)[1])
    with cutting_proxy(("127.0.0.1", port), cut_after=3000, cuts=1) as proxy:
        proxy.on_cut = touch
        body = BoxBody(f"{proxy.url}/v1/checkpoints/llama", [Box("model.embed_tokens.weight", (0, 0), (250, 64)),
                                                              Box("model.norm.weight", (0,), (64,))], token=TOKEN, backoff=0.01)
        with pytest.raises(IntegrityError, match="changed on the server"):
            body.readinto(memoryview(bytearray(body.size)))
        body.close()


def _quiet(srv: LiveServer) -> tuple[float, float]:
    """What the server has streamed so far, once the streams of earlier tests are counted: shard streams
    opened, body bytes sent."""
    assert streams_settled(srv)
    return metric(srv, "reshard_shard_streams_total"), metric(srv, "reshard_shard_bytes_served_total")


def test_bad_input_is_answered_4xx_and_nothing_is_streamed(served: tuple[LiveServer, Path]) -> None:
    srv, root = served
    name = "model.embed_tokens.weight"
    shapes = {n: list(t.shape) for n, t in full_tensors(root / "llama").items()}
    before = _quiet(srv)
    cases: list[tuple[Any, int, str, str]] = [
        ({"boxes": [{"name": name, "offsets": [-1, 0], "sizes": [1, 1]}]}, 422, "ValidationError",
         "greater than or equal to 0"),
        ({"boxes": [{"name": name, "offsets": [240, 0], "sizes": [11, 64]}]}, 400, "BoxError",
         "dim 0 ends at 251 (offset 240 + size 11), past its size 250"),
        ({"boxes": [{"name": "nope.weight", "offsets": [0], "sizes": [1]}]}, 400, "BoxError",
         "no tensor named 'nope.weight'"),
        ({"boxes": [{"name": name, "offsets": [0], "sizes": [1]}]}, 400, "BoxError", "1 offsets and 1 sizes for a 2-d"),
        ({"boxes": [{"name": name, "offsets": [0, 0], "sizes": [1, 1]}] * 2}, 400, "BoxError", "more than once"),
        ({"boxes": [{"name": name, "offsets": [0, 0], "sizes": [1, 1], "dtype": "x"}]}, 422, "ValidationError",
         "Extra inputs"),
        ({"boxes": [{"name": name, "offsets": [0.5, 0], "sizes": [1, 1]}]}, 422, "ValidationError", "integer"),
        ({"boxes": []}, 422, "ValidationError", "at least 1"),
        ([name], 422, "ValidationError", ""),
        (b'{"boxes": [', 422, "ValidationError", "not JSON"),
        ({"boxes": [{"name": name, "offsets": [i % 250, 0], "sizes": [1, 1]} for i in range(1001)]}, 400, "BoxError",
         "1001 boxes in one request, over the 1000"),
        ({"boxes": [{"name": n, "offsets": [0] * len(s), "sizes": s} for n, s in shapes.items()]}, 400, "BoxError",
         "228480 bytes in all, over the 200000 bytes"),
        ({"boxes": [{"name": "cube", "offsets": [0, 1, 2], "sizes": [400, 1, 1]}]}, 400, "BoxError",
         "up to 400 separate runs"),
    ]
    for body, status, error, fragment in cases:
        r = _post(srv, "cube" if "cube" in str(body) else "llama", body)
        assert (r.status_code, r.json()["error"]) == (status, error), (body if not isinstance(body, dict) else
                                                                       str(body)[:200], r.text)
        assert fragment in r.json()["detail"], r.json()
    big = {"boxes": [{"name": "a", "offsets": [0], "sizes": [1]}] * 10**6}  # 10^6 boxes: refused by its size
    t0 = time.monotonic()
    r = _post(srv, "llama", json.dumps(big).encode())
    assert (r.status_code, r.json()["error"]) == (413, "PayloadTooLarge") and time.monotonic() - t0 < 30
    assert "16777216-byte limit" in r.json()["detail"]
    assert _quiet(srv) == before  # nothing was planned into a stream for any of them


def test_the_work_bounds_name_their_setting(served: tuple[LiveServer, Path]) -> None:
    srv, root = served
    full = full_tensors(root / "llama")
    whole = [Box.whole(n, full[n].shape) for n in sorted(full)]
    with pytest.raises(BoxError, match=r"228480 bytes in all, over the 200000 bytes one request may ask for"):
        read_boxes(srv.ckpt_url("llama"), whole, token=TOKEN)
    r = _post(srv, "llama", {"boxes": [b.to_json() for b in whole]}, path="boxes/digest")
    assert r.status_code == 400 and "200000" in r.json()["detail"]
    cube = load_file(root / "cube" / "model.safetensors")["cube"]
    rows = Box("cube", (100, 1, 0), (200, 1, 4))  # whole rows of the last dim: one strided run
    column = Box("cube", (0, 1, 2), (400, 1, 1))  # one element of each of 400 rows: 400 runs
    gt = Checkpoint.open(root / "cube").global_tensors()["cube"]
    assert runs_bound(gt, rows) == 1 and runs_bound(gt, column) == 400
    assert torch.equal(read_boxes(srv.ckpt_url("cube"), [rows], token=TOKEN)[0], cube[100:300, 1:2, :])
    with pytest.raises(BoxError, match="up to 400 separate runs of source bytes, over the 300 one request may cause"):
        read_boxes(srv.ckpt_url("cube"), [column], token=TOKEN)
    assert torch.equal(read_boxes(root / "cube", [column])[0], cube[:, 1:2, 2:3])  # the library has no bound


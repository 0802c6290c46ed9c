"""`--resume URL`: a training checkpoint served by a real `reshard serve --root ROOT` (ROOT/NAME the
checkpoint directory) resumes like the directory: its trainer state from the small files, the parameters
from `NAME/shards/R`, the moments from `NAME/optimizer/shards/R`, each rank pulling only its own share.

The reference is the directory resume of the same checkpoint: at the saved tp=2 (two gloo ranks, one
process group for every tp=2 run) and at tp=1 (in process), the losses equal it exactly.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from reshard.format.meta_files import META_NAMES
from reshard.format.rank_file import OPTIMIZER_DIR, rank_file_name
from reshard.trainer.state_json import STATE_NAME
from tests.support.dist import run_distributed
from tests.support.live import live_server
from tests.support.trainer_archs import make_checkpoint, write_shards

COMMON = ["--seq-len", "16", "--batch-size", "2", "--seed", "3", "--lr", "1e-3", "--warmup", "2", "--min-lr", "1e-4",
          "--max-norm", "0.5", "--dtype", "float32", "--threads", "1"]
STEPS = 6
SERVED = "reshard_shard_bytes_served_total"


def _train(*args: str) -> dict[str, Any]:
    from reshard.cli.train import parse_args, train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train(parse_args([*args, *COMMON]))
    summary["stdout"] = out.getvalue()
    return summary


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(SERVED))


def _job(rank: int, world: int, shards: str, root: str, url: str) -> dict[str, Any]:
    """The 6-step tp=2 run checkpointing at step 3 (under the server's root), then its resume from the URL
    (the bytes the server sent for it counted) and from the directory."""
    import torch.distributed as dist

    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    _train("--shards", shards, "--steps", str(STEPS), "--save", f"{root}/a", "--save-every", "3")
    dist.barrier()
    before = _served(url)
    by_url = _train("--resume", f"{url}/v1/checkpoints/step-3", "--steps", str(STEPS), "--save", f"{root}/b_url")
    dist.barrier()
    sent = _served(url) - before
    by_dir = _train("--resume", f"{root}/a/step-3", "--steps", str(STEPS), "--save", f"{root}/b_dir")
    return {"url": by_url, "dir": by_dir, "sent": sent}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("resume_service")
    write_shards(make_checkpoint("llama", root / "full"), 2, root / "tp2")
    (root / "a").mkdir()
    with live_server(root / "a") as srv:
        at2 = run_distributed(_job, 2, str(root / "tp2"), str(root), srv.url, timeout=180)
        ckpt_url = srv.ckpt_url("step-3")
        tp1 = {"url": _train("--resume", ckpt_url, "--steps", str(STEPS)),
               "dir": _train("--resume", str(root / "a" / "step-3"), "--steps", str(STEPS))}
        meta = httpx.get(ckpt_url + "/meta").json()["files"]
        missing = httpx.get(srv.ckpt_url("step-3") + "/nope/shards/0", params={"tp": 2}).status_code
    return {"root": root, "at2": at2, "tp1": tp1, "meta": meta, "missing": missing, "url": ckpt_url}


@pytest.mark.servers
def test_url_resume_at_the_saved_layout_equals_the_directory_resume(runs: dict[str, Any]) -> None:
    root = runs["root"]
    for rank in runs["at2"]:
        by_url, by_dir = rank["url"], rank["dir"]
        assert (by_url["first_step"], by_url["layout"], by_url["resumed_from"]) == (4, {"dp": 1, "tp": 2}, runs["url"])
        assert by_url["losses"] == by_dir["losses"]  # bit for bit
    assert f"resumed from {runs['url']} at step 3" in runs["at2"][0]["url"]["stdout"]
    for sub in (".", OPTIMIZER_DIR):  # the final states too
        for r in range(2):
            a, b = load_file(root / "b_url" / sub / rank_file_name(r, 2)), load_file(root / "b_dir" / sub / rank_file_name(r, 2))
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), (sub, r)
    # each rank pulled its own share once: the parameters' and the moments' rank files, no more
    files = sum((root / "a" / "step-3" / sub / rank_file_name(r, 2)).stat().st_size
                for sub in (".", OPTIMIZER_DIR) for r in range(2))
    assert runs["at2"][0]["sent"] == files


@pytest.mark.servers
def test_url_resume_at_another_tp_equals_the_directory_resume(runs: dict[str, Any]) -> None:
    by_url, by_dir = runs["tp1"]["url"], runs["tp1"]["dir"]
    assert (by_url["first_step"], by_url["layout"]) == (4, {"dp": 1, "tp": 1})
    assert "(saved at tp=2, cut to tp=1 as read)" in by_url["stdout"]
    assert by_url["losses"] == by_dir["losses"]  # the service cuts the bytes the directory resume cuts


@pytest.mark.servers
def test_the_service_lists_the_trainer_state(runs: dict[str, Any]) -> None:
    assert STATE_NAME in META_NAMES
    state = next(f for f in runs["meta"] if f["name"] == STATE_NAME)
    assert state["size"] == (runs["root"] / "a" / "step-3" / STATE_NAME).stat().st_size
    assert json.loads((runs["root"] / "a" / "step-3" / STATE_NAME).read_text())["step"] == 3
    assert runs["missing"] == 422  # only `optimizer` names a part of a checkpoint

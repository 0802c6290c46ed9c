"""The tools know training checkpoints: `reshard plan` shows the optimizer's bytes, `reshard write` re-lays the
whole checkpoint out (parameters, `optimizer/`, `trainer_state.json`), `reshard merge --optimizer` gives the
moments under the parameters' names.

One gloo job of 4 ranks: a 6-step run at dp=2 x tp=2 saving its tp=2 checkpoint at step 3, that checkpoint
re-laid at tp=4 and at fsdp=2 x tp=2 by `reshard write`, then resumed at tp=4 twice (cut as read from the
tp=2 files, and from the re-laid directory) and at fsdp=2 x tp=2 three times (cut as read, re-laid, and
from a real `reshard serve`). The references: the resumes of one layout against each other (identical),
the dp=2 x tp=2 run, a tp=1 run of the same model and data in process (the unsharded AdamW), and the
sizes of the files `reshard write` wrote.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main as reshard_cli
from reshard.format.rank_file import OPTIMIZER_DIR, OPTIMIZER_SLOTS, rank_file_name
from reshard.io.hashing import file_sha256
from reshard.trainer.resume import reseed
from reshard.trainer.state_json import decode_rng, read_state
from tests.support.dist import run_distributed
from tests.support.live import live_server
from tests.support.trainer_archs import make_checkpoint, write_shards

COMMON = ["--seq-len", "16", "--batch-size", "2", "--seed", "3", "--lr", "1e-3", "--warmup", "2", "--min-lr", "1e-4",
          "--max-norm", "0.5", "--dtype", "float32", "--threads", "1"]
STEPS = 6


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = reshard_cli([*args])
    return rc, out.getvalue()


def _job(rank: int, world: int, shards: str, root: str, url: str) -> None:
    """dp=2 x tp=2 to step 6 saving step 3; `reshard write` of it at tp=4 and fsdp=2 x tp=2 (rank 0); the
    resumes at tp=4 and fsdp=2 x tp=2 (`url`: the service's URL of the step-3 checkpoint)."""
    import torch.distributed as dist

    from reshard.cli.train import parse_args, train

    os.environ["WORLD_SIZE"] = str(world)
    train(parse_args(["--shards", shards, "--steps", str(STEPS), "--dp", "2", "--save", f"{root}/a",
                      "--save-every", "3", "--metrics", f"{root}/a.json", *COMMON]))
    if rank == 0:
        assert reshard_cli(["write", f"{root}/a/step-3", "--tp", "4", "-o", f"{root}/r4", "--no-progress"]) == 0
        assert reshard_cli(["write", f"{root}/a/step-3", "--fsdp", "2", "--tp", "2", "-o", f"{root}/rf",
                            "--no-progress"]) == 0
    dist.barrier()
    fsdp = ["--fsdp", "2"]
    for name, src, more in (("fly", f"{root}/a/step-3", []), ("relaid", f"{root}/r4", []),
                            ("fly_f", f"{root}/a/step-3", fsdp), ("relaid_f", f"{root}/rf", fsdp), ("url_f", url, fsdp)):
        train(parse_args(["--resume", src, "--steps", str(STEPS), "--metrics", f"{root}/{name}.json", *more, *COMMON]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from reshard.cli.train import main as train_main

    root = tmp_path_factory.mktemp("ckpt_tools")
    full = make_checkpoint("llama", root / "full")
    for tp in (1, 2):
        write_shards(full, tp, root / f"tp{tp}")
    (root / "a").mkdir()
    with live_server(root / "a") as srv:
        run_distributed(_job, 4, str(root / "tp2"), str(root), srv.ckpt_url("step-3"), timeout=240)
    with contextlib.redirect_stdout(io.StringIO()):  # the unsharded reference, to the same step 3
        assert train_main(["--shards", str(root / "tp1"), "--steps", str(STEPS), "--save", str(root / "one"),
                           "--save-every", "3", *COMMON]) == 0
    return root


def _metrics(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.multiproc
def test_relaid_checkpoint_resumes_identically(runs: Path) -> None:
    fly, relaid, ref = (_metrics(runs / f"{n}.json") for n in ("fly", "relaid", "a"))
    assert (fly["layout"], relaid["layout"], relaid["first_step"]) == ({"dp": 1, "tp": 4}, {"dp": 1, "tp": 4}, 4)
    assert relaid["losses"] == fly["losses"]  # identical: the same bytes, the same reseeded RNG
    diff = max(abs(x - y) for x, y in zip(fly["losses"], ref["losses"][3:], strict=True))
    print(f"resumed at tp=4 (re-laid and cut as read) vs the dp=2 x tp=2 run: max |loss diff| {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.multiproc
def test_fsdp_resumes_cut_as_read_relaid_and_served_are_identical(runs: Path) -> None:
    """At fsdp=2 x tp=2 from the dp=2 x tp=2 checkpoint: the resume cutting the tp=2 files as it reads, the one
    from `reshard write --fsdp 2 --tp 2`'s files and the one from the service agree bit for bit, and with
    the uninterrupted run within float32 noise."""
    fly, relaid, url, ref = (_metrics(runs / f"{n}.json") for n in ("fly_f", "relaid_f", "url_f", "a"))
    assert (fly["layout"], fly["first_step"], url["first_step"]) == ({"dp": 1, "fsdp": 2, "tp": 2}, 4, 4)
    assert relaid["losses"] == fly["losses"] and url["losses"] == fly["losses"]
    diff = max(abs(x - y) for x, y in zip(fly["losses"], ref["losses"][3:], strict=True))
    print(f"resumed at fsdp=2 x tp=2 (cut as read, re-laid, served) vs the dp=2 x tp=2 run: max |loss diff| {diff:.3g}")
    assert diff < 1e-5
    state = read_state(runs / "rf")
    assert state is not None and (state["layout"], state["relaid_from"], len(state["rng"])) == ({"fsdp": 2, "tp": 2},
                                                                                                  {"tp": 2}, 4)


@pytest.mark.multiproc
def test_relaid_state_and_files(runs: Path) -> None:
    src, out = read_state(runs / "a" / "step-3"), read_state(runs / "r4")  # read_state: every file present
    assert src is not None and out is not None
    for key in ("step", "optimizer", "scheduler", "generators", "extra"):
        assert out[key] == src[key], key
    assert (out["layout"], out["relaid_from"]) == ({"tp": 4}, {"tp": 2})
    names = [rank_file_name(r, 4) for r in range(4)]
    assert sorted(out["files"]) == sorted([*names, *(f"{OPTIMIZER_DIR}/{n}" for n in names)])
    for name, sha in out["files"].items():
        assert file_sha256(runs / "r4" / name) == sha, name
    for r, entry in enumerate(out["rng"]):  # what a resume at another layout seeds each rank's generator to
        torch.manual_seed(reseed(src["extra"]["seed"], src["step"], r))
        assert torch.equal(decode_rng(entry["torch"]), torch.get_rng_state()), r


@pytest.mark.multiproc
def test_plan_shows_optimizer_bytes(runs: Path) -> None:
    rc, text = _cli("plan", str(runs / "a" / "step-3"), "--tp", "4", "--json")
    assert rc == 0
    plan = json.loads(text)
    for entry in plan["ranks"]:  # the bytes `reshard write` then wrote
        r = entry["rank"]
        assert entry["bytes"] == (runs / "r4" / rank_file_name(r, 4)).stat().st_size
        assert entry["optimizer_bytes"] == (runs / "r4" / OPTIMIZER_DIR / rank_file_name(r, 4)).stat().st_size
    assert [e["bytes"] for e in plan["optimizer"]["ranks"]] == [e["optimizer_bytes"] for e in plan["ranks"]]
    rc, text = _cli("plan", str(runs / "a" / "step-3"), "--tp", "4")
    assert rc == 0 and "optimizer" in text.splitlines()[3] and "training checkpoint: optimizer" in text


@pytest.mark.multiproc
def test_merge_optimizer_equals_unsharded_run(runs: Path) -> None:
    for name, src in (("m2", runs / "a" / "step-3"), ("m1", runs / "one" / "step-3")):
        rc, _ = _cli("merge", str(src), "-o", str(runs / name), "--optimizer", "--no-progress")
        assert rc == 0
    weights = load_file(runs / "m2" / "model.safetensors")
    for slot in OPTIMIZER_SLOTS:
        m2 = load_file(runs / "m2" / OPTIMIZER_DIR / slot / "model.safetensors")
        m1 = load_file(runs / "m1" / OPTIMIZER_DIR / slot / "model.safetensors")
        assert {k: v.shape for k, v in m2.items()} == {k: v.shape for k, v in weights.items()}  # the parameters' names
        assert (runs / "m2" / OPTIMIZER_DIR / slot / "config.json").is_file()
        worst = max((m2[k] - m1[k]).abs().max().item() for k in m1)
        print(f"merged {slot}: tp=2 (dp=2) vs tp=1 max |diff| {worst:.3g}")
        for k in m1:
            torch.testing.assert_close(m2[k], m1[k], atol=1e-6, rtol=1e-3, msg=k)
    rc, _ = _cli("merge", str(runs / "tp2"), "-o", str(runs / "bad"), "--optimizer", "--no-progress")
    assert rc != 0 and not (runs / "bad" / "model.safetensors").exists()  # refused before writing anything


@pytest.mark.multiproc
def test_merge_is_byte_identical_across_layouts(runs: Path) -> None:
    """The same checkpoint at tp=2 (as saved), tp=4 and tp=1 (`reshard write`) merges to the same bytes."""
    rc, _ = _cli("write", str(runs / "a" / "step-3"), "--tp", "1", "-o", str(runs / "r1"), "--no-progress")
    assert rc == 0
    files = ["model.safetensors", "config.json", *(f"{OPTIMIZER_DIR}/{s}/model.safetensors" for s in OPTIMIZER_SLOTS)]
    merged = {}
    for name in ("a/step-3", "r4", "r1"):
        out = runs / "merged" / name.replace("/", "-")
        rc, _ = _cli("merge", str(runs / name), "-o", str(out), "--optimizer", "--no-progress")
        assert rc == 0
        merged[name] = {f: (out / f).read_bytes() for f in files}
    assert merged["r4"] == merged["a/step-3"] and merged["r1"] == merged["a/step-3"]
    rc, _ = _cli("merge", str(runs / "r1"), "-o", str(runs / "plain"), "--no-progress")  # weights only, as before
    assert rc == 0 and not (runs / "plain" / OPTIMIZER_DIR).exists()
    assert (runs / "plain" / "model.safetensors").read_bytes() == merged["r1"]["model.safetensors"]

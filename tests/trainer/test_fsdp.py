"""`--fsdp F`: the TP model sharded with torch's `fully_shard` over F ranks (world = dp x fsdp x tp).

The references are the runs without FSDP: tp=1 in process (the unsharded math) for training, the
dp=2 x tp=2 run that saved the tp=2 checkpoint for the resume. All the 4-rank runs share one gloo job.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import ReshardError
from reshard.format.rank_file import OPTIMIZER_DIR, rank_file_name
from reshard.trainer.groups import make_groups
from reshard.trainer.state_json import read_state
from tests.support.dist import run_distributed
from tests.support.trainer_archs import make_checkpoint, write_shards
from tests.support.trainer_checks import RESUME_ARGS, RESUME_STEPS, read_metrics, train_here

TOL = 1e-5  # float32 reduction-order noise on the tiny llama's losses


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint and its rank shards `tp1`, `tp2`."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("fsdp")
    full = make_checkpoint("llama", root / "full")
    for tp in (1, 2):
        write_shards(full, tp, root / f"tp{tp}")
    return root


def _job(rank: int, world: int, shards: str, root: str) -> None:
    """Four ranks: dp=2 x tp=2 saving a tp=2 checkpoint at step 3; fsdp=2 x tp=2 from the shards (saving
    at step 3 too); both checkpoints resumed at fsdp=2 x tp=2; dp=2 x fsdp=2 x tp=1 (HSDP, a global batch of 4)."""
    from reshard.cli.train import parse_args, train

    os.environ["WORLD_SIZE"] = str(world)
    steps = ["--steps", str(RESUME_STEPS), *RESUME_ARGS]
    train(parse_args(["--shards", shards, "--dp", "2", "--save", f"{root}/d", "--save-every", "3",
                      "--metrics", f"{root}/d.json", *steps]))
    train(parse_args(["--shards", shards, "--fsdp", "2", "--save", f"{root}/f", "--save-every", "3",
                      "--metrics", f"{root}/f.json", *steps]))
    train(parse_args(["--resume", f"{root}/d/step-3", "--fsdp", "2", "--metrics", f"{root}/rd.json", *steps]))
    train(parse_args(["--resume", f"{root}/f/step-3", "--fsdp", "2", "--metrics", f"{root}/rf.json", *steps]))
    train(parse_args(["--shards", f"{shards}/../tp1", "--dp", "2", "--fsdp", "2", "--metrics", f"{root}/h.json",
                      *steps, "--batch-size", "4"]))  # HSDP: 4 data ranks


@pytest.fixture(scope="module")
def runs(shards: Path) -> Path:
    root = shards / "runs"
    rc, _, err = train_here("--shards", str(shards / "tp1"), "--steps", str(RESUME_STEPS), "--metrics", str(root / "ref.json"))
    assert rc == 0, err
    from reshard.cli.train import main

    with contextlib.redirect_stdout(io.StringIO()):  # the reference of the HSDP run: a global batch of 4
        assert main(["--shards", str(shards / "tp1"), "--steps", str(RESUME_STEPS), "--metrics", str(root / "ref4.json"),
                     *RESUME_ARGS, "--batch-size", "4"]) == 0
    run_distributed(_job, 4, str(shards / "tp2"), str(root), timeout=240)
    return root


def _diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.multiproc
def test_fsdp_training_matches_the_unsharded_run(runs: Path) -> None:
    """fsdp=2 x tp=2 and dp=2 x fsdp=2 x tp=1 see the same global batch as tp=1: the same losses and
    clipping norms (clipping on), within float32 noise."""
    for name, layout, batch in (("f", {"dp": 1, "fsdp": 2, "tp": 2}, 2), ("h", {"dp": 2, "fsdp": 2, "tp": 1}, 4)):
        m, ref = read_metrics(runs / f"{name}.json"), read_metrics(runs / ("ref.json" if batch == 2 else "ref4.json"))
        assert (m["layout"], m["samples"], len(m["losses"])) == (layout, RESUME_STEPS * batch, RESUME_STEPS)
        d, n = _diff(m["losses"], ref["losses"]), _diff(m["grad_norms"], ref["grad_norms"])
        print(f"{layout} vs tp=1: max |loss diff| {d:.3g}, max |grad norm diff| {n:.3g}")
        assert d < TOL and n < 1e-4 * max(ref["grad_norms"])
    assert any(g > 0.5 for g in ref["grad_norms"])  # --max-norm 0.5 did clip


@pytest.mark.multiproc
def test_fsdp_checkpoint_holds_each_ranks_chunks(runs: Path) -> None:
    """Saved at fsdp=2 x tp=2, every rank wrote its own rank file of fsdp=2 x tp=2 (nothing gathered): each
    tensor, parameters and moments, is torch.chunk's dim-0 part of what the dp=2 x tp=2 run saved in its tp
    rank's file (within float32 noise), and the checkpoint resumes exactly at fsdp=2 x tp=2."""
    worst = 0.0
    for step, at in ((3, "step-3"), (RESUME_STEPS, ".")):  # the checkpoint of step 3 and the final one
        f, d = runs / "f" / at, runs / "d" / at
        state = read_state(f)
        assert state is not None and (state["layout"], state["step"]) == ({"fsdp": 2, "tp": 2}, step)
        assert sorted(p.name for p in f.glob("rank-*")) == [rank_file_name(r, 4) for r in range(4)]
        for sub in (".", OPTIMIZER_DIR):
            for r in range(4):
                fsdp_rank, tp_rank = divmod(r, 2)
                a, b = load_file(f / sub / rank_file_name(r, 4)), load_file(d / sub / rank_file_name(tp_rank, 2))
                assert sorted(a) == sorted(b)
                for k in a:
                    chunks = b[k].chunk(2, dim=0) if b[k].dim() else (b[k], b[k])
                    want = chunks[fsdp_rank] if fsdp_rank < len(chunks) else b[k][:0]
                    torch.testing.assert_close(a[k], want, atol=1e-6, rtol=1e-4, msg=k)
                    worst = max(worst, float((a[k] - want).abs().max()) if a[k].numel() else 0.0)
    print(f"checkpoints saved at fsdp=2 x tp=2 vs dp=2 x tp=2, chunked: max |diff| {worst:.3g}")
    rf, fm = read_metrics(runs / "rf.json"), read_metrics(runs / "f.json")
    assert rf["first_step"] == 4 and rf["losses"] == fm["losses"][3:]  # bit for bit


@pytest.mark.multiproc
def test_resume_at_fsdp2_tp2_from_a_tp2_checkpoint(runs: Path) -> None:
    rd, ref = read_metrics(runs / "rd.json"), read_metrics(runs / "d.json")["losses"][3:]
    assert (rd["layout"], rd["first_step"], rd["samples"]) == ({"dp": 1, "fsdp": 2, "tp": 2}, 4, RESUME_STEPS * 2)
    d = _diff(rd["losses"], ref)
    print(f"resumed at fsdp=2 x tp=2 vs the tp=2 run: max |loss diff| {d:.3g}")
    assert d < TOL


@pytest.mark.pure
def test_fsdp_sizes_are_checked_in_one_line(shards: Path) -> None:
    from reshard.cli.train import main

    with pytest.raises(ReshardError, match=r"--dp 1 x --fsdp 3: the world of 4 ranks is not a multiple"):
        make_groups(1, fsdp=3, world=4, rank=0)
    for extra, says in ((["--fsdp", "2"], "--dp 1 x --fsdp 2: the world of 1 ranks is not a multiple of it"),
                        (["--dp", "2", "--fsdp", "2", "--batch-size", "6"],
                         "--batch-size 6 is the global batch, split across --dp 2 x --fsdp 2 = 4 data ranks; "
                         "pick a multiple of 4")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main(["--shards", str(shards / "tp1"), "--steps", "1", *extra]) == 1
        assert err.getvalue().count("\n") == 1 and says in err.getvalue(), err.getvalue()

"""Training checkpoints and `--resume`: the whole state saved (parameters, AdamW's moments and step, the
generators), atomically, and a resume at the same layout that equals the run never stopped, bit for bit.

The reference is always the uninterrupted run of the same model, data and seed: at tp=1 in process, at
tp=2 in two gloo ranks (one `run_distributed` for all the tp=2 runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reshard.format.rank_file import (
    OPTIMIZER_DIR,
    decode_metadata,
    optimizer_tensor_name,
    parse_optimizer_tensor_name,
    rank_file_name,
)
from reshard.io.sinks.hf_checkpoint import merge
from reshard.trainer.state_json import STATE_NAME, read_state
from tests.support.dist import run_distributed
from tests.support.trainer_archs import make_checkpoint, write_shards
from tests.support.trainer_checks import (
    RESUME_ARGS,
    RESUME_STEPS,
    checkpoint_tensors,
    read_metrics,
    train_here,
)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint (`full`) and its rank shards `tp1`, `tp2`."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("resume")
    full = make_checkpoint("llama", root / "full")
    for tp in (1, 2):
        write_shards(full, tp, root / f"tp{tp}")
    return root


def _assert_same_state(a: Path, b: Path, tp: int) -> None:
    ta, tb = checkpoint_tensors(a, tp), checkpoint_tensors(b, tp)
    assert sorted(ta) == sorted(tb)
    unequal = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert unequal == [], unequal[:5]
    sa, sb = read_state(a), read_state(b)
    assert sa is not None and sb is not None
    assert (sa["step"], sa["files"], sa["generators"]) == (sb["step"], sb["files"], sb["generators"])


@pytest.mark.pure
def test_optimizer_tensor_names_round_trip() -> None:
    name = optimizer_tensor_name("model.layers.0.mlp.up_proj.weight", "exp_avg_sq")
    assert name == "model.layers.0.mlp.up_proj.weight.exp_avg_sq"
    assert parse_optimizer_tensor_name(name) == ("model.layers.0.mlp.up_proj.weight", "exp_avg_sq")
    assert parse_optimizer_tensor_name("model.layers.0.mlp.up_proj.weight") is None
    with pytest.raises(ValueError, match="not one of"):
        optimizer_tensor_name("w", "momentum")


@pytest.fixture(scope="module")
def tp1_runs(shards: Path) -> Path:
    """At tp=1, in process: 6 steps checkpointed every step keeping 4, then resumed from step-3 to 6."""
    root = shards / "runs1"
    rc, out, err = train_here("--shards", str(shards / "tp1"), "--steps", str(RESUME_STEPS), "--save", str(root / "a"),
                          "--save-every", "1", "--keep", "4", "--metrics", str(root / "a.json"))
    assert rc == 0, err
    rc, out, err = train_here("--resume", str(root / "a" / "step-3"), "--steps", str(RESUME_STEPS), "--save", str(root / "b"),
                          "--metrics", str(root / "b.json"))
    assert rc == 0, err
    assert f"resumed from {root / 'a' / 'step-3'} at step 3" in out
    return root


@pytest.mark.pure
def test_tp1_resume_is_exact(tp1_runs: Path) -> None:
    a, b = read_metrics(tp1_runs / "a.json"), read_metrics(tp1_runs / "b.json")
    assert (a["first_step"], b["first_step"], len(b["losses"])) == (1, 4, 3)
    assert b["losses"] == a["losses"][3:]  # bit for bit
    assert b["resumed_from"] == str(tp1_runs / "a" / "step-3")
    _assert_same_state(tp1_runs / "a", tp1_runs / "b", 1)
    assert sorted(p.name for p in (tp1_runs / "a").iterdir() if p.name.startswith("step-")) == \
        ["step-3", "step-4", "step-5", "step-6"]  # --keep 4
    _assert_same_state(tp1_runs / "a" / "step-6", tp1_runs / "a", 1)


@pytest.mark.pure
def test_checkpoint_holds_adamw_moments(tp1_runs: Path) -> None:
    """Both moments of every parameter, under the names `format.rank_file` derives, with its shape and its
    description (kind, shape, selection), and the step-6 checkpoint's are the ones a 6-step run ends with."""
    moments = load_file(tp1_runs / "a" / "step-3" / OPTIMIZER_DIR / rank_file_name(0, 1))
    params = load_file(tp1_runs / "a" / "step-3" / rank_file_name(0, 1))
    assert sorted(moments) == sorted(optimizer_tensor_name(n, s) for n in params for s in ("exp_avg", "exp_avg_sq"))
    for n, p in params.items():
        assert moments[optimizer_tensor_name(n, "exp_avg")].shape == p.shape
        assert moments[optimizer_tensor_name(n, "exp_avg_sq")].min() >= 0
    assert any(m.abs().max() > 0 for m in moments.values())
    described = {}
    for sub in (".", OPTIMIZER_DIR):
        with safe_open(str(tp1_runs / "a" / "step-3" / sub / rank_file_name(0, 1)), "pt") as f:
            described[sub] = decode_metadata(f.metadata(), sub).tensors
    for name, spec in described[OPTIMIZER_DIR].items():
        param, _ = parse_optimizer_tensor_name(name)
        assert spec == described["."][param], name


@pytest.mark.pure
def test_weights_only_resume_starts_fresh(shards: Path, tp1_runs: Path) -> None:
    rc, out, err = train_here("--resume", str(shards / "tp1"), "--steps", "2", "--metrics", str(tp1_runs / "w.json"))
    assert rc == 0, err
    assert f"{shards / 'tp1'}: weights only (no {STATE_NAME}): starting with a fresh optimizer at step 0" in out
    w, a = read_metrics(tp1_runs / "w.json"), read_metrics(tp1_runs / "a.json")
    assert w["first_step"] == 1 and w["losses"] == a["losses"][:2]  # the same as --shards


@pytest.mark.pure
def test_corrupt_or_incomplete_checkpoint_is_one_clear_error(tp1_runs: Path, tmp_path: Path) -> None:
    bad = shutil.copytree(tp1_runs / "a" / "step-3", tmp_path / "bad")
    opt = bad / OPTIMIZER_DIR / rank_file_name(0, 1)
    data = bytearray(opt.read_bytes())
    data[-3] ^= 0xFF
    opt.write_bytes(bytes(data))
    rc, out, err = train_here("--resume", str(bad), "--steps", str(RESUME_STEPS))
    assert rc == 1 and "step " not in out.replace("at step", "")
    assert err.strip().count("\n") == 0 and "does not match the recorded" in err, err
    opt.unlink()
    rc, out, err = train_here("--resume", str(bad), "--steps", str(RESUME_STEPS))
    assert rc == 1 and "incomplete checkpoint" in err and "resume from an earlier checkpoint" in err, err


@pytest.mark.pure
def test_saved_config_names_the_saved_dtype(tmp_path: Path) -> None:
    """A bfloat16 checkpoint trained in float32 is saved in float32 and its config.json says so (and so does
    `reshard merge`'s); resuming it in bfloat16 is the same model (the fingerprint ignores the dtype)."""
    import json

    import transformers

    full = make_checkpoint("llama", tmp_path / "fp32")
    transformers.AutoModelForCausalLM.from_pretrained(full, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    write_shards(tmp_path / "bf16", 1, tmp_path / "tp1")
    rc, _, err = train_here("--shards", str(tmp_path / "tp1"), "--steps", "1", "--save", str(tmp_path / "ck"),
                            "--dtype", "float32")
    assert rc == 0, err
    merge(tmp_path / "ck", tmp_path / "merged", progress=False)
    for d in (tmp_path / "ck", tmp_path / "merged"):
        assert json.loads((d / "config.json").read_text())["dtype"] == "float32", d
    assert {t.dtype for t in load_file(tmp_path / "merged" / "model.safetensors").values()} == {torch.float32}
    from reshard.cli.train import main

    with contextlib.redirect_stdout(out := io.StringIO()):
        assert main(["--resume", str(tmp_path / "ck"), "--steps", "2", "--dtype", "bfloat16", "--seq-len", "16",
                     "--batch-size", "2", "--threads", "1"]) == 0
    assert "resumed from" in out.getvalue()


# --- two gloo ranks --------------------------------------------------------------------------------------


def _tp2_job(rank: int, world: int, shards: str, root: str) -> None:
    """The uninterrupted 6-step run checkpointing at step 3, then the resume from step-3 (rank 0 writes metrics)."""
    from reshard.cli.train import parse_args, train

    os.environ["WORLD_SIZE"] = str(world)
    train(parse_args(["--shards", shards, "--steps", str(RESUME_STEPS), "--save", f"{root}/a", "--save-every", "3",
                      "--metrics", f"{root}/a.json", *RESUME_ARGS]))
    train(parse_args(["--resume", f"{root}/a/step-3", "--steps", str(RESUME_STEPS), "--save", f"{root}/b",
                      "--metrics", f"{root}/b.json", *RESUME_ARGS]))
    # the same checkpoint at dp=2 x tp=1: each replica cuts the whole model out of the tp=2 files
    train(parse_args(["--resume", f"{root}/a/step-3", "--steps", str(RESUME_STEPS), "--dp", "2",
                      "--metrics", f"{root}/dp2.json", *RESUME_ARGS]))


def _killed_job(rank: int, world: int, shards: str, root: str) -> None:
    """Checkpoints every step; rank 1 is SIGKILLed while writing its optimizer file of step 2."""
    import reshard.trainer.snapshot as snapshot
    from reshard.cli.train import parse_args, train

    real = snapshot.write_rank_file

    def dying(path: Path, *args: Any) -> str:
        if rank == 1 and ".step-2.partial" in str(path) and OPTIMIZER_DIR in str(path):
            path.write_bytes(b"half a file")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args)

    snapshot.write_rank_file = dying
    os.environ["WORLD_SIZE"] = str(world)
    train(parse_args(["--shards", shards, "--steps", "3", "--save", f"{root}/k", "--save-every", "1", *RESUME_ARGS]))


@pytest.fixture(scope="module")
def tp2_runs(shards: Path) -> Path:
    root = shards / "runs2"
    run_distributed(_tp2_job, 2, str(shards / "tp2"), str(root), timeout=120)
    return root


@pytest.mark.multiproc
def test_tp2_resume_is_exact_and_matches_tp1(tp2_runs: Path, tp1_runs: Path) -> None:
    root = tp2_runs
    a, b = read_metrics(root / "a.json"), read_metrics(root / "b.json")
    assert (a["tp"], b["tp"], b["first_step"]) == (2, 2, 4)
    assert b["losses"] == a["losses"][3:]  # bit for bit
    _assert_same_state(root / "a", root / "b", 2)
    ref = read_metrics(tp1_runs / "a.json")["losses"]
    diff = max(abs(x - y) for x, y in zip(a["losses"], ref, strict=True))
    print(f"tp=2 vs tp=1 losses: max |diff| {diff:.3g}")
    assert diff < 1e-5
    # the tp=2 checkpoint's moments, merged, are the tp=1 run's (the unsharded AdamW), within fp32 noise
    merge(root / "a" / "step-3" / OPTIMIZER_DIR, root / "m2", progress=False)
    merge(tp1_runs / "a" / "step-3" / OPTIMIZER_DIR, root / "m1", progress=False)
    m2, m1 = load_file(root / "m2" / "model.safetensors"), load_file(root / "m1" / "model.safetensors")
    assert sorted(m2) == sorted(m1)
    for k in m1:
        torch.testing.assert_close(m2[k], m1[k], atol=1e-6, rtol=1e-3, msg=k)


def _tp4_job(rank: int, world: int, root: str) -> None:
    from reshard.cli.train import parse_args, train

    os.environ["WORLD_SIZE"] = str(world)
    train(parse_args(["--resume", f"{root}/a/step-3", "--steps", str(RESUME_STEPS), "--metrics", f"{root}/tp4.json", *RESUME_ARGS]))


@pytest.mark.multiproc
def test_another_models_files_are_one_clear_error(tp1_runs: Path, tp2_runs: Path, tmp_path: Path) -> None:
    """A checkpoint whose parameter files and config.json are another model's (qwen2 in place of the llama its
    trainer state and moments were saved with): at the saved layout the recorded sha256 refuses them, at
    another (tp=2 files resumed at tp=1, cut as read: no whole-file hash) the model's fingerprint does; one
    line each, no step trained."""
    other = make_checkpoint("qwen2", tmp_path / "qwen2")
    for tp, runs, says in ((1, tp1_runs, "does not match the recorded"), (2, tp2_runs, "are of another model")):
        bad = shutil.copytree(runs / "a" / "step-3", tmp_path / f"bad{tp}")
        write_shards(other, tp, tmp_path / f"other{tp}")
        for name in [*(rank_file_name(r, tp) for r in range(tp)), "config.json"]:
            shutil.copy(tmp_path / f"other{tp}" / name, bad / name)
        rc, out, err = train_here("--resume", str(bad), "--steps", str(RESUME_STEPS))
        assert rc == 1 and "step " not in out.replace("at step", ""), out
        assert err.strip().count("\n") == 0 and says in err, err


@pytest.mark.multiproc
def test_resume_at_another_tp_agrees(tp2_runs: Path) -> None:
    """The tp=2 checkpoint of step 3 resumed at tp=1 (in process), tp=4 and dp=2 x tp=1 (gloo), each rank
    cutting its slices of the parameters and moments as it reads them: steps 4-6 agree with the tp=2 run."""
    root = tp2_runs
    rc, out, err = train_here("--resume", str(root / "a" / "step-3"), "--steps", str(RESUME_STEPS),
                          "--metrics", str(root / "tp1.json"))
    assert rc == 0, err
    assert "(saved at tp=2, cut to tp=1 as read)" in out
    run_distributed(_tp4_job, 4, str(root), timeout=120)
    ref = read_metrics(root / "a.json")["losses"][3:]
    for name, layout in (("tp1", {"dp": 1, "tp": 1}), ("tp4", {"dp": 1, "tp": 4}), ("dp2", {"dp": 2, "tp": 1})):
        m = read_metrics(root / f"{name}.json")
        assert (m["layout"], m["first_step"], m["samples"]) == (layout, 4, RESUME_STEPS * 2)
        diff = max(abs(x - y) for x, y in zip(m["losses"], ref, strict=True))
        print(f"resumed at {layout} vs tp=2: max |loss diff| {diff:.3g}")
        assert diff < 1e-5


@pytest.mark.multiproc
def test_cut_as_read_equals_reshard_write(tp2_runs: Path, tmp_path: Path) -> None:
    """What a resume at another tp reads is, byte for byte, the rank file `reshard write` makes of it."""
    from reshard.fill.open import open_relaid_stream

    ckpt = tp2_runs / "a" / "step-3"
    for sub in (ckpt, ckpt / OPTIMIZER_DIR):
        for tp in (1, 4):
            out = write_shards(sub, tp, tmp_path / f"{sub.name}-{tp}")
            for rank in range(tp):
                _, chunks, _ = open_relaid_stream(sub, rank, tp)
                assert b"".join(bytes(c) for c in chunks) == (out / rank_file_name(rank, tp)).read_bytes(), (sub, rank)


@pytest.mark.multiproc
def test_sigkill_mid_save_leaves_previous_checkpoint(shards: Path) -> None:
    root = shards / "killed"
    with pytest.raises((RuntimeError, AssertionError)):
        run_distributed(_killed_job, 2, str(shards / "tp2"), str(root), timeout=60)
    k = root / "k"
    assert not (k / "step-2").exists() and not (k / STATE_NAME).exists()
    partial = list(k.glob(".step-2.partial-*"))
    assert len(partial) == 1 and (partial[0] / OPTIMIZER_DIR).is_dir()  # killed mid-save, as meant
    assert not (partial[0] / STATE_NAME).exists()  # nothing that claims to be complete
    state = read_state(k / "step-1")
    assert state is not None and state["step"] == 1
    for name, sha in state["files"].items():
        assert hashlib.sha256((k / "step-1" / name).read_bytes()).hexdigest() == sha, name

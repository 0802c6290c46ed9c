"""The training loop's parts (issue 34, item 2): the warmup + cosine schedule, the global data cursor,
gradient clipping by the unsharded model's norm, and data parallelism beside TP, each against the
unsharded math (a tp=1 run of the same model and data, torch's own `clip_grad_norm_`).
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli.train import main as train_main
from reshard.cli.train import parse_args, train
from reshard.io.sinks.hf_checkpoint import merge
from reshard.trainer import build_model, causal_lm_loss
from reshard.trainer.clip import GlobalGradNorm, element_weights
from reshard.trainer.cursor import local_share, sample_windows, window_start
from reshard.trainer.schedule import make_optimizer, make_scheduler
from tests.support.dist import run_distributed
from tests.support.trainer_archs import SMALL, make_checkpoint, rules, write_shards

STEPS, LR, MAX_NORM, SEED = 3, 1e-3, 0.5, 7
LOSS_ATOL, NORM_RTOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-5
TRAIN = ["--steps", str(STEPS), "--seq-len", "16", "--batch-size", "4", "--seed", str(SEED), "--lr", str(LR),
         "--warmup", "1", "--min-lr", "1e-4", "--max-norm", str(MAX_NORM), "--dtype", "float32", "--threads", "1"]


# --- pure: the schedule, the cursor, the weights of the norm ------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize(("steps", "warmup", "min_lr"), [(10, 3, 1e-4), (6, 0, 0.0), (5, 0, None), (4, 4, 1e-5)])
def test_schedule_follows_the_formula(steps: int, warmup: int, min_lr: float | None) -> None:
    opt = make_optimizer(torch.nn.Linear(2, 2), lr=LR)
    sched = make_scheduler(opt, steps=steps, warmup=warmup, min_lr=min_lr)
    floor = LR if min_lr is None else min_lr
    for s in range(steps):
        if s < warmup:
            expected = LR * s / warmup
        else:
            t = (s - warmup) / max(1, steps - 1 - warmup)
            expected = floor + 0.5 * (LR - floor) * (1 + math.cos(math.pi * t))
        assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15), s
        opt.step()
        sched.step()
    if warmup < steps - 1:
        assert sched.get_last_lr()[0] == pytest.approx(floor)  # min-lr reached at the last step
    state = sched.state_dict()
    again = make_scheduler(make_optimizer(torch.nn.Linear(2, 2), lr=LR), steps=steps, warmup=warmup, min_lr=min_lr)
    again.load_state_dict(state)
    assert again.last_epoch == steps and again.get_last_lr() == sched.get_last_lr()


@pytest.mark.pure
def test_sample_is_a_function_of_seed_and_index() -> None:
    tokens = torch.arange(1000)
    whole = sample_windows(tokens, seed=SEED, first=8, count=8, seq_len=16)
    assert torch.equal(whole[:, 0], torch.tensor([window_start(SEED, i, 1000 - 17) for i in range(8, 16)]))
    assert torch.equal(whole[:, 1:] - whole[:, :-1], torch.ones(8, 16, dtype=torch.long))  # contiguous windows
    shares = [sample_windows(tokens, seed=SEED, first=8 + o, count=n, seq_len=16)
              for o, n in (local_share(8, 4, d) for d in range(4))]
    assert torch.equal(torch.cat(shares), whole)  # the replicas' shares are the global batch, in order
    assert not torch.equal(sample_windows(tokens, seed=SEED + 1, first=8, count=8, seq_len=16), whole)
    with pytest.raises(Exception, match="--batch-size 6 .* --dp 4"):
        local_share(6, 4, 0)


@pytest.mark.pure
def test_norm_weights_count_each_element_once() -> None:
    col = [[[[0, 4]], [[0, 3]]], [[[4, 8]], [[0, 3]]]]  # dim 0 split over 2 ranks
    assert element_weights(col[1], [8, 3], col) == 1.0
    assert element_weights([[[0, 3]]], [3], [[[[0, 3]]]] * 4) == 0.25  # replicated on 4 ranks
    padded = [[[[0, 3]]], [[[3, 6]]]]  # 5 rows at tp=2: row 5 is padding
    assert torch.equal(element_weights(padded[1], [5], padded).flatten(), torch.tensor([1.0, 1.0, 0.0]))
    shared = [[[[0, 2], [4, 5]]], [[[2, 4], [4, 5]]]]  # packed q|k: q split, the k block on both ranks
    assert torch.equal(element_weights(shared[0], [5], shared).flatten(), torch.tensor([1.0, 1.0, 0.5]))


@pytest.mark.pure
def test_batch_not_divisible_by_dp_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["--shards", str(tmp_path), "--dp", "2", "--batch-size", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--batch-size 3" in err and "--dp 2" in err, err


# --- real ranks: clipping norm, TP and DP against tp=1 ------------------------------------------------


def _dense_kv1(out: Path) -> Path:
    """A llama with one kv head: at tp=2 both ranks hold it (its norm weight must be halved)."""
    import transformers
    import yaml

    config = transformers.AutoConfig.for_model("llama", **{**SMALL, "num_key_value_heads": 1})
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    (out / "reshard-rules.yaml").write_text(yaml.safe_dump({"rules": rules(config)}, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama (kv heads 1 < tp: shared) and qwen3_moe (experts, per-head q/k norms): full, tp1, tp2."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("loop")
    fulls = {"llama_kv1": _dense_kv1(root / "llama_kv1" / "full"),
             "qwen3_moe": make_checkpoint("qwen3_moe", root / "qwen3_moe" / "full")}
    for name, full in fulls.items():
        for tp in (1, 2):
            write_shards(full, tp, root / name / f"tp{tp}")
    return {"root": root}


def _first_batch(vocab: int) -> torch.Tensor:
    tokens = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8).long() % vocab
    return sample_windows(tokens, seed=SEED, first=0, count=4, seq_len=16)


def _norm(shards: Path) -> float:
    """GlobalGradNorm of the first batch's gradients on this rank's model (tp = the world)."""
    model = build_model(str(shards))
    ids = _first_batch(model.config.vocab_size)
    causal_lm_loss(model, ids[:, :-1], ids[:, 1:]).backward()
    return GlobalGradNorm(model).norm().item()


def _run(argv: list[str]) -> dict[str, Any]:
    with contextlib.redirect_stdout(io.StringIO()):
        return train(parse_args(argv))


def loop_job(rank: int, world_size: int, root: str, norm_of: list[str], runs: dict[str, list[str]]) -> dict[str, Any]:
    """In one process group: the norm at tp=world of each checkpoint in `norm_of`, then each CLI run."""
    torch.set_num_threads(1)
    norms = {name: _norm(Path(root) / name / f"tp{world_size}") for name in norm_of}
    return {"norms": norms, "runs": {key: _run(argv) for key, argv in runs.items()}}


def _argv(ckpts: dict[str, Path], name: str, tp: int, key: str, *extra: str) -> list[str]:
    out = ckpts["root"] / "runs" / key
    return ["--shards", str(ckpts["root"] / name / f"tp{tp}"), *TRAIN, "--save", str(out), *extra]


@pytest.fixture(scope="module")
def runs(ckpts: dict[str, Path]) -> dict[str, Any]:
    """tp=1 in this process (the reference); tp=2 and dp=2 x tp=1 in one 2-rank group; dp=2 x tp=2 on 4 ranks."""
    torch.set_num_threads(1)
    ref_norms = {}
    for name in ("llama_kv1", "qwen3_moe"):
        model = build_model(str(ckpts["root"] / name / "tp1"))
        ids = _first_batch(model.config.vocab_size)
        causal_lm_loss(model, ids[:, :-1], ids[:, 1:]).backward()
        ref_norms[name] = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    ref = {f"{name}_tp1": _run(_argv(ckpts, name, 1, f"{name}_tp1")) for name in ("llama_kv1", "qwen3_moe")}
    two = {"llama_kv1_tp2": _argv(ckpts, "llama_kv1", 2, "llama_kv1_tp2"),
           "qwen3_moe_tp2": _argv(ckpts, "qwen3_moe", 2, "qwen3_moe_tp2"),
           "llama_kv1_dp2": _argv(ckpts, "llama_kv1", 1, "llama_kv1_dp2", "--dp", "2")}
    at2 = run_distributed(loop_job, 2, str(ckpts["root"]), list(ref_norms), two, timeout=240.0)
    four = {"llama_kv1_dp2_tp2": _argv(ckpts, "llama_kv1", 2, "llama_kv1_dp2_tp2", "--dp", "2")}
    at4 = run_distributed(loop_job, 4, str(ckpts["root"]), [], four, timeout=240.0)
    return {"ref_norms": ref_norms, "ref": ref, "at2": at2, "at4": at4}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["llama_kv1", "qwen3_moe"])
def test_clipping_norm_at_tp2_equals_tp1(runs: dict[str, Any], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    expected = runs["ref_norms"][name]  # torch's clip_grad_norm_ on the unsharded (tp=1) model
    for rank in runs["at2"]:
        assert rank["norms"][name] == pytest.approx(expected, rel=NORM_RTOL), (name, expected)
    run, ref = runs["at2"][0]["runs"][f"{name}_tp2"], runs["ref"][f"{name}_tp1"]
    with capsys.disabled():
        print(f"\n{name}: step-1 norm tp=2 {runs['at2'][0]['norms'][name]:.7f} vs torch tp=1 {expected:.7f}; "
              f"run: max |loss diff| {max(abs(a - b) for a, b in zip(run['losses'], ref['losses'], strict=True)):.2e}"
              f", max rel norm diff "
              f"{max(abs(a / b - 1) for a, b in zip(run['grad_norms'], ref['grad_norms'], strict=True)):.2e}")
    assert run["layout"] == {"dp": 1, "tp": 2} and ref["layout"] == {"dp": 1, "tp": 1}
    assert all(n > MAX_NORM for n in ref["grad_norms"]), ref["grad_norms"]  # clipping was active
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=LOSS_ATOL)


def _merged(run_dir: Path) -> dict[str, torch.Tensor]:
    merge(run_dir, run_dir / "merged", progress=False)
    return load_file(run_dir / "merged" / "model.safetensors")


@pytest.mark.multiproc
@pytest.mark.parametrize(("key", "world", "layout"), [("llama_kv1_dp2", "at2", {"dp": 2, "tp": 1}),
                                                     ("llama_kv1_dp2_tp2", "at4", {"dp": 2, "tp": 2})])
def test_dp2_equals_dp1_on_the_same_global_batch(
    runs: dict[str, Any], ckpts: dict[str, Path], key: str, world: str, layout: dict[str, int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    ref = runs["ref"]["llama_kv1_tp1"]
    for rank in runs[world]:  # every rank reports the global batch's loss
        run = rank["runs"][key]
        assert run["layout"] == layout
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=LOSS_ATOL)
        torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]),
                                   rtol=NORM_RTOL, atol=0)
        assert (run["first_step"], run["samples"], run["final_lr"]) == (1, STEPS * 4, ref["final_lr"]) == (
            ref["first_step"], ref["samples"], ref["final_lr"])
    saved, expected = _merged(ckpts["root"] / "runs" / key), _merged(ckpts["root"] / "runs" / "llama_kv1_tp1")
    assert sorted(saved) == sorted(expected)
    worst = max((saved[k] - expected[k]).abs().max().item() for k in expected)
    with capsys.disabled():
        run = runs[world][0]["runs"][key]
        print(f"\n{key} vs dp=1 x tp=1: max |loss diff| "
              f"{max(abs(a - b) for a, b in zip(run['losses'], ref['losses'], strict=True)):.2e}, max rel norm diff "
              f"{max(abs(a / b - 1) for a, b in zip(run['grad_norms'], ref['grad_norms'], strict=True)):.2e}, "
              f"max |weight diff| {worst:.2e}")
    assert worst <= WEIGHT_ATOL

"""The TP trainer on real gloo ranks (tp = 2 and 4) against the unsharded model (tp = 1).

Logits and losses of models built with `build_model` from rank shards, training under torchrun
(losses and final weights), save -> merge / reshard round trips, peak memory of the meta-device
build, and the errors a wrong shard directory gives.
"""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from trainer_checks import (
    PYTHON,
    REPO,
    build_memory_job,
    global_slice,
    logits_job,
    rank_tensors,
    run_distributed,
    run_train,
)

from reshard.cli import main as reshard_cli
from reshard.errors import CheckpointError
from reshard.merge import merge
from reshard.plan import rank_file_name
from reshard.synth import llama_config, make_checkpoint
from reshard.trainer import build_model
from reshard.trainer.model import LlamaForCausalLM, ModelConfig

SMALL = {"vocab_size": 301, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
CONFIGS = {
    # kv heads 2 < tp 4: kv heads are replicated; vocab 301 is not divisible by 2 or 4: padding
    "llama_gqa": llama_config(**SMALL),
    "tied": llama_config(**SMALL, tie_word_embeddings=True),
    "qwen2_bias": llama_config(model_type="qwen2", **SMALL, rope_theta=1e6),
    # fused qkv_proj (packed q|k|v) whose k and v blocks are shared by two ranks each at tp=4
    "phi3_fused": llama_config(model_type="phi3", **SMALL),
}
TPS = (1, 2, 4)
LOGIT_ATOL = 1e-5
GRAD_ATOL = 1e-6
LOSS_ATOL = 1e-4
WEIGHT_ATOL = 1e-5
LR = 1e-4
# Adam divides by sqrt(v) + 1e-8: for an element whose gradient is within ~1e-8 of zero at some step,
# fp32 rounding noise (different summation order per tp) moves its update by up to ~lr. Such elements
# are rare (~1 in 1e5 per step); they may exceed WEIGHT_ATOL, bounded by that update size. The
# gradients themselves are compared exactly (GRAD_ATOL) in `test_gradients_match_unsharded`.
MAX_NOISY_FRACTION = 1e-3


def _ids() -> torch.Tensor:
    ids = torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(5))
    ids[0, :3] = torch.tensor([0, 300, 228])  # the first and last rows, and the last partition at tp=4
    return ids


IDS = _ids()


def _write(src: Path, tp: int, out: Path) -> Path:
    assert reshard_cli(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 0
    return out


def _merged(shard_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    summary = merge(shard_dir, out, progress=False)
    assert summary["files"] == ["model.safetensors"]
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per config: the full checkpoint `NAME/full` and its rank shards `NAME/tpN`."""
    root = tmp_path_factory.mktemp("tp_trainer")
    for name, config in CONFIGS.items():
        full = make_checkpoint(root / name / "full", config, std=0.1, seed=1)
        for tp in TPS:
            _write(full, tp, root / name / f"tp{tp}")
    return root


def _reference(work: Path, name: str) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    state = load_file(work / name / "full" / "model.safetensors")
    model = LlamaForCausalLM(ModelConfig.from_hf(CONFIGS[name]))
    model.load_state_dict(state, strict=True)
    return model.eval(), state


@pytest.fixture(scope="module")
def references(work: Path) -> dict[str, dict[str, Any]]:
    """Unsharded logits and loss per config, from the full state dict and from `build_model(tp1)`."""
    out = {}
    for name in CONFIGS:
        model, _ = _reference(work, name)
        built = build_model(work / name / "tp1")  # world size 1: no process group at all
        with torch.no_grad():
            logits = model(IDS)
            built_logits = built(IDS)
        loss = F.cross_entropy(model(IDS)[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
        loss.backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        out[name] = {"logits": logits, "loss": loss.item(), "built_tp1": built_logits, "grads": grads}
    return out


@pytest.fixture(scope="module")
def tp_runs(work: Path) -> Any:
    """One spawned job per world size (built lazily): every config's logits, saved shards, errors."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(tp: int) -> list[dict[str, Any]]:
        if tp not in cache:
            cases = {name: str(work / name / f"tp{tp}") for name in CONFIGS}
            wrong = [str(work / "llama_gqa" / f"tp{4 if tp == 2 else 2}")]
            cache[tp] = run_distributed(logits_job, tp, cases, IDS, str(work / f"saved_tp{tp}"), wrong,
                                        timeout=180.0)
        return cache[tp]

    return get


# --- logits and loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_logits_and_loss_match_unsharded(tp_runs: Any, references: dict, tp: int, name: str) -> None:
    results = tp_runs(tp)
    ref = references[name]
    assert ref["logits"].abs().max() > 1.0  # the comparison is not trivially small
    torch.testing.assert_close(ref["built_tp1"], ref["logits"], atol=LOGIT_ATOL, rtol=0)
    for rank, res in enumerate(results):
        logits = res["logits"][name]
        assert logits.shape == (2, 12, 301), f"rank {rank}: padding leaked into the logits"
        assert torch.equal(logits, results[0]["logits"][name]), f"rank {rank} disagrees with rank 0"
        torch.testing.assert_close(logits, ref["logits"], atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(logits, ref["built_tp1"], atol=LOGIT_ATOL, rtol=0)
        assert abs(res["loss"][name] - ref["loss"]) < LOGIT_ATOL, (rank, res["loss"][name], ref["loss"])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_gradients_match_unsharded(tp_runs: Any, references: dict, tp: int, name: str) -> None:
    """One backward of `causal_lm_loss`: every rank's local gradient is its slice of the full gradient
    (summed over the ranks sharing a kv head; zero in tp padding rows; full for replicated tensors)."""
    full = references[name]["grads"]
    for rank, res in enumerate(tp_runs(tp)):
        grads, selects = res["grads"][name], res["selects"][name]
        assert sorted(grads) == sorted(full), rank
        for key, grad in grads.items():
            expected = global_slice(full[key], selects[key])
            assert grad.shape == expected.shape, (rank, key)
            torch.testing.assert_close(grad, expected, atol=GRAD_ATOL, rtol=1e-4,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")


@pytest.mark.parametrize("tp", [2, 4])
def test_local_parameter_shapes(tp_runs: Any, tp: int) -> None:
    """Each rank holds 1/tp of every split tensor: vocab padded up, kv heads shared when 2 < tp."""
    vocab_rows = -(-301 // tp)
    for rank, res in enumerate(tp_runs(tp)):
        shapes = res["local_shapes"]["llama_gqa"]
        assert shapes["model.embed_tokens.weight"] == (vocab_rows, 64), rank
        assert shapes["lm_head.weight"] == (vocab_rows, 64), rank
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64 // tp, 64), rank
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64), rank  # one of 2 kv heads
        assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 64 // tp), rank
        assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 128 // tp), rank
        assert shapes["model.norm.weight"] == (64,), rank
        # the groups of ranks sharing a kv head are made once per model, not once per layer
        assert res["new_groups"]["llama_gqa"] == (2 if tp == 4 else 0), rank
        qwen = res["local_shapes"]["qwen2_bias"]
        assert qwen["model.layers.0.self_attn.v_proj.bias"] == (16,), rank
        assert "model.layers.0.self_attn.o_proj.bias" not in qwen
        phi3 = res["local_shapes"]["phi3_fused"]
        assert phi3["model.layers.0.self_attn.qkv_proj.weight"] == (64 // tp + 16 + 16, 64), rank
        assert phi3["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 128 // tp, 64), rank
        assert res["new_groups"]["phi3_fused"] == (2 if tp == 4 else 0), rank
        tied = res["local_shapes"]["tied"]
        assert "lm_head.weight" not in tied  # one parameter, shared with the embedding
        assert tied["model.embed_tokens.weight"] == (vocab_rows, 64), rank


def test_logits_match_transformers(tp_runs: Any, work: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = CONFIGS["llama_gqa"]
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), attn_implementation="eager")
    hf.load_state_dict(load_file(work / "llama_gqa" / "full" / "model.safetensors"), strict=True)
    with torch.no_grad():
        expected = hf.eval()(input_ids=IDS).logits
    torch.testing.assert_close(tp_runs(2)[0]["logits"]["llama_gqa"], expected, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_saved_shards_merge_back_to_the_checkpoint(tp_runs: Any, work: Path, tmp_path: Path, tp: int,
                                                   name: str) -> None:
    """`save_rank_shard` of an untrained model + `reshard merge` gives back the very same tensors."""
    tp_runs(tp)
    saved = work / f"saved_tp{tp}" / name
    assert sorted(p.name for p in saved.glob("rank-*")) == [rank_file_name(r, tp) for r in range(tp)]
    merged = _merged(saved, tmp_path / "merged")
    original = load_file(work / name / "full" / "model.safetensors")
    assert sorted(merged) == sorted(original)
    if name == "tied":
        assert "lm_head.weight" not in merged
    for key, tensor in original.items():
        assert torch.equal(merged[key], tensor), key
    assert json.loads((tmp_path / "merged" / "config.json").read_text()) == CONFIGS[name]


# --- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "have"), [(2, 4), (4, 2)])
def test_shards_of_another_tp_give_a_clear_error(tp_runs: Any, work: Path, tp: int, have: int) -> None:
    shard_dir = str(work / "llama_gqa" / f"tp{have}")
    for res in tp_runs(tp):
        error = res["errors"][shard_dir]
        assert error is not None, f"building tp={have} shards in a world of {tp} did not fail"
        kind, message = error
        assert kind == "CheckpointError"
        assert f"tp={tp}" in message and f"tp=[{have}]" in message, message
        assert f"reshard write {shard_dir} --tp {tp}" in message, message


def test_shards_of_another_tp_without_a_process_group(work: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tp=\[2\]\); run `reshard write .* --tp 1 -o DIR`"):
        build_model(work / "llama_gqa" / "tp2")


# --- resharding the shards --------------------------------------------------------------------------


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(4, 2), (2, 4), (4, 1)])
def test_reshard_of_shards_equals_direct_write(work: Path, tmp_path: Path, src_tp: int, dst_tp: int) -> None:
    for name in ("llama_gqa", "tied"):
        out = _write(work / name / f"tp{src_tp}", dst_tp, tmp_path / name)
        direct = work / name / f"tp{dst_tp}"
        files = [rank_file_name(r, dst_tp) for r in range(dst_tp)]
        match, mismatch, errors = filecmp.cmpfiles(out, direct, files, shallow=False)
        assert (match, mismatch, errors) == (files, [], []), name


# --- training ----------------------------------------------------------------------------------------


def _train(work: Path, tp: int, steps: int) -> dict[str, Any]:
    run = work / f"train_tp{tp}_{steps}"
    proc = run_train(work / "llama_gqa" / f"tp{tp}", tp, steps=steps, save=run / "saved",
                     metrics=run / "metrics.json", lr=LR)
    return {"proc": proc, "metrics": json.loads((run / "metrics.json").read_text()),
            "saved": run / "saved", "weights": _merged(run / "saved", run / "merged")}


@pytest.fixture(scope="module")
def train_tp1_5(work: Path) -> dict[str, Any]:
    return _train(work, 1, 5)


@pytest.fixture(scope="module")
def train_tp2_5(work: Path) -> dict[str, Any]:
    return _train(work, 2, 5)


@pytest.fixture(scope="module")
def train_tp1_3(work: Path) -> dict[str, Any]:
    return _train(work, 1, 3)


@pytest.fixture(scope="module")
def train_tp4_3(work: Path) -> dict[str, Any]:
    return _train(work, 4, 3)


def _same_training(run: dict[str, Any], ref: dict[str, Any], work: Path, tp: int, steps: int) -> None:
    m, r = run["metrics"], ref["metrics"]
    assert (m["tp"], m["steps"], len(m["losses"])) == (tp, steps, steps)
    assert (r["tp"], r["steps"], len(r["losses"])) == (1, steps, steps)
    for step, (a, b) in enumerate(zip(m["losses"], r["losses"], strict=True)):
        assert abs(a - b) < LOSS_ATOL, f"step {step + 1}: tp={tp} loss {a} vs tp=1 loss {b}"
    assert len(m["shard_bytes_per_rank"]) == tp
    original = load_file(work / "llama_gqa" / "full" / "model.safetensors")
    weights, expected = run["weights"], ref["weights"]
    assert sorted(weights) == sorted(expected) == sorted(original)
    noisy = 0
    for key in expected:
        diff = (weights[key] - expected[key]).abs()
        noisy += int((diff > WEIGHT_ATOL).sum())
        # an outlier is at most one step's worth of Adam update per step (see MAX_NOISY_FRACTION)
        assert diff.max() <= LR * steps, (key, diff.max().item())
        # training moved every tensor by far more than the tolerance (Adam: about lr per step)
        assert (expected[key] - original[key]).abs().max() > 10 * WEIGHT_ATOL, key
    total = sum(t.numel() for t in expected.values())
    assert noisy <= max(2, MAX_NOISY_FRACTION * total), f"{noisy} of {total} weights differ by > {WEIGHT_ATOL}"


def test_tp2_training_matches_tp1(work: Path, train_tp2_5: dict, train_tp1_5: dict) -> None:
    _same_training(train_tp2_5, train_tp1_5, work, 2, 5)


def test_tp4_training_round_trip_matches_tp1(work: Path, train_tp4_3: dict, train_tp1_3: dict) -> None:
    """full -> tp=4 (kv heads shared by two ranks each) -> 3 steps -> save -> merge == tp=1."""
    _same_training(train_tp4_3, train_tp1_3, work, 4, 3)
    ranks = [rank_tensors(train_tp4_3["saved"] / rank_file_name(r, 4)) for r in range(4)]
    for layer in range(2):
        for proj in ("k_proj", "v_proj"):
            key = f"model.layers.{layer}.self_attn.{proj}.weight"
            # ranks sharing a kv head summed its gradient: their copies stayed identical
            assert torch.equal(ranks[0][key], ranks[1][key]) and torch.equal(ranks[2][key], ranks[3][key]), key
            assert not torch.equal(ranks[0][key], ranks[2][key]), key


def test_tp1_run_without_torchrun_prints_losses(train_tp1_5: dict) -> None:
    stdout = train_tp1_5["proc"].stdout
    printed = [float(x) for x in re.findall(r"^step +\d+/5 +loss (\S+)", stdout, flags=re.M)]
    losses = train_tp1_5["metrics"]["losses"]
    assert printed == [round(x, 4) for x in losses], stdout
    assert all(4.0 < x < 8.0 for x in losses), losses  # about ln(301) = 5.7 for a random model


def test_train_help() -> None:
    proc = subprocess.run([PYTHON, "-m", "reshard.train", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--shards", "--steps", "--save", "--metrics", "--seq-len", "--dtype"):
        assert option in proc.stdout


# --- memory of the meta-device build ---------------------------------------------------------------

BIG = llama_config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)
MB = 1 << 20


def test_build_peak_memory_shrinks_with_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = make_checkpoint(tmp_path / "full", BIG)
    state = load_file(full / "model.safetensors")
    model_bytes = sum(t.nbytes for t in state.values())
    replicated = sum(t.nbytes for k, t in state.items() if k.endswith("norm.weight"))
    del state
    assert 60 * MB < model_bytes < 90 * MB
    peaks: dict[int, list[dict[str, int]]] = {}
    for tp in TPS:
        shards = _write(full, tp, tmp_path / f"tp{tp}")
        peaks[tp] = run_distributed(build_memory_job, tp, str(shards), timeout=180.0)
        for rank, res in enumerate(peaks[tp]):
            file_bytes = (shards / rank_file_name(rank, tp)).stat().st_size
            assert res["param_bytes"] <= file_bytes <= res["param_bytes"] + MB
            assert res["peak_increase"] >= res["param_bytes"] * 0.9, (tp, rank, res)
            assert res["peak_increase"] < model_bytes / tp + replicated + 30 * MB, (tp, rank, res)
            assert res["peak_increase"] < file_bytes + 30 * MB, (tp, rank, res)
    worst = {tp: max(r["peak_increase"] for r in peaks[tp]) for tp in TPS}
    with capsys.disabled():
        print(f"\nbuild_model peak RSS increase per rank (model {model_bytes / MB:.1f} MiB): " + ", ".join(
            f"tp={tp}: " + "/".join(f"{r['peak_increase'] / MB:.1f}" for r in peaks[tp]) + " MiB" for tp in TPS))
    assert worst[2] < 0.7 * worst[1], worst
    assert worst[4] < worst[2] * 0.9, worst

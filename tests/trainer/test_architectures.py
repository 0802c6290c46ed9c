"""transformers' own models, built per rank on the meta device from rank shards, against transformers'
single-process model on the full checkpoint: logits, the vocab-parallel loss, gradients, and the saved
shards merging back to the checkpoint (per-expert names on disk for MoE), at tp=2 for every
architecture in `tests.support.trainer_archs.ARCHS` and at tp=4 where kv heads (2) are fewer than tp.

One launch of real gloo ranks per world size; the ranks loop over the architectures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.hf_checkpoint import merge
from reshard.trainer import build_model
from tests.support.trainer_archs import ARCHS, GRADS, IDS, MOE_ARCHS, TP4, hf_config
from tests.support.trainer_checks import arch_job, global_slice, run_distributed

LOGIT_ATOL = 1e-5
GRAD_ATOL = 1e-5


@pytest.fixture(scope="session")
def tp_runs(arch_work: Path) -> Any:
    """One spawned job per world size (built lazily): every architecture's results on every rank."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(tp: int) -> list[dict[str, Any]]:
        if tp not in cache:
            names = list(ARCHS) if tp == 2 else list(TP4)
            cases = {name: str(arch_work / name / f"tp{tp}") for name in names}
            wrong = [str(arch_work / "llama" / f"tp{4 if tp == 2 else 2}")]
            cache[tp] = run_distributed(arch_job, tp, cases, IDS, str(arch_work / f"saved_tp{tp}"),
                                        [g for g in GRADS if g in names], wrong, timeout=400.0)
        return cache[tp]

    return get


CASES = [(2, name) for name in ARCHS] + [(4, name) for name in TP4]


@pytest.mark.multiproc
@pytest.mark.parametrize(("tp", "name"), CASES)
def test_logits_and_loss_match_transformers(tp_runs: Any, references: dict, tp: int, name: str) -> None:
    ref = references[name]
    assert ref["logits"].abs().max() > 0.1  # the comparison is not trivially small
    for rank, res in enumerate(tp_runs(tp)):
        logits = res["logits"][name]
        assert logits.shape == (2, 12, 301), f"rank {rank}: padding leaked into the logits"
        assert torch.equal(logits, tp_runs(tp)[0]["logits"][name]), f"rank {rank} disagrees with rank 0"
        torch.testing.assert_close(logits, ref["logits"], atol=LOGIT_ATOL, rtol=0)
        assert abs(res["loss"][name] - ref["loss"]) < LOGIT_ATOL, (rank, res["loss"][name], ref["loss"])


@pytest.mark.multiproc
@pytest.mark.parametrize(("tp", "name"), [(tp, n) for tp, n in CASES if n in GRADS])
def test_gradients_match_transformers(tp_runs: Any, references: dict, tp: int, name: str) -> None:
    """One backward of `causal_lm_loss`: every rank's local gradient is its slice of transformers'
    full gradient (summed over the ranks sharing a kv head; zero in padding rows; full when replicated)."""
    full = references[name]["grads"]
    for rank, res in enumerate(tp_runs(tp)):
        grads, selects = res["grads"][name], res["selects"][name]
        assert sorted(grads) == sorted(full), rank
        for key, grad in grads.items():
            expected = global_slice(full[key], selects[key])
            torch.testing.assert_close(grad, expected, atol=GRAD_ATOL, rtol=1e-4,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")


@pytest.mark.multiproc
def test_the_model_is_transformers_own_class(tp_runs: Any) -> None:
    import transformers

    for name, cls in tp_runs(2)[0]["classes"].items():
        assert cls == transformers.AutoModelForCausalLM._model_mapping[type(hf_config(name))].__name__, name


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [2, 4])
def test_local_shapes(tp_runs: Any, tp: int) -> None:
    """1/tp of every split tensor: vocab padded up, kv heads shared when 2 < tp, experts split per expert."""
    vocab_rows = -(-301 // tp)
    for rank, res in enumerate(tp_runs(tp)):
        shapes = res["local_shapes"]["llama"]
        assert shapes["model.embed_tokens.weight"] == (vocab_rows, 64), rank
        assert shapes["lm_head.weight"] == (vocab_rows, 64), rank
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64 // tp, 64), rank
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64), rank  # one of 2 kv heads
        assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 64 // tp), rank
        assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 128 // tp), rank
        assert shapes["model.norm.weight"] == (64,), rank
        # share groups: once per model, each rank creating only its own (the ranks sharing its kv head)
        assert res["new_groups"]["llama"] == (1 if tp == 4 else 0), rank
        phi3 = res["local_shapes"]["phi3"]
        assert phi3["model.layers.0.self_attn.qkv_proj.weight"] == (64 // tp + 16 + 16, 64), rank
        mixtral = res["local_shapes"]["mixtral"]
        assert mixtral["model.layers.0.mlp.experts.gate_up_proj"] == (4, 2 * 128 // tp, 64), rank
        assert mixtral["model.layers.0.mlp.experts.down_proj"] == (4, 64, 128 // tp), rank
        assert mixtral["model.layers.0.mlp.gate.weight"] == (4, 64), rank  # the router stays whole
    tied = tp_runs(2)[0]["local_shapes"]["llama_tied"]
    assert "lm_head.weight" not in tied  # one parameter, shared with the embedding


@pytest.mark.multiproc
@pytest.mark.parametrize(("tp", "name"), CASES)
def test_saved_shards_merge_back_to_the_checkpoint(tp_runs: Any, arch_work: Path, tmp_path: Path, tp: int,
                                                   name: str) -> None:
    """`save_rank_shard` of the untrained model + `reshard merge` gives back the very same tensors,
    under the names on disk (per-expert MoE tensors out of transformers' fused parameters)."""
    tp_runs(tp)
    saved = arch_work / f"saved_tp{tp}" / name
    assert sorted(p.name for p in saved.glob("rank-*")) == [rank_file_name(r, tp) for r in range(tp)]
    merge(saved, tmp_path / "merged", progress=False)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    original = load_file(arch_work / name / "full" / "model.safetensors")
    assert sorted(merged) == sorted(original)
    if name in MOE_ARCHS:
        assert any(".experts.3." in k for k in merged)
    for key, tensor in original.items():
        assert torch.equal(merged[key], tensor), key


@pytest.mark.multiproc
@pytest.mark.parametrize(("tp", "have"), [(2, 4), (4, 2)])
def test_shards_of_another_tp_are_cut_as_read(tp_runs: Any, arch_work: Path, tp: int, have: int) -> None:
    """Rank files of tp=`have` build the tp=`tp` model: each rank's bytes cut from them as they are read,
    the same model (bit for bit) as from the rank files of tp=`tp`."""
    shard_dir = str(arch_work / "llama" / f"tp{have}")
    for rank, res in enumerate(tp_runs(tp)):
        name, logits = res["cut"][shard_dir]
        assert f"(rank {rank} of tp={tp}, cut as read)" in name, name
        assert torch.equal(logits, res["logits"]["llama"])


@pytest.mark.pure
def test_shards_of_another_tp_without_a_process_group(arch_work: Path) -> None:
    """tp=2 rank files build the tp=1 model (cut as read), the same as from tp=1's files."""
    cut, direct = (build_model(arch_work / "llama" / d).eval() for d in ("tp2", "tp1"))
    assert "cut as read" in cut.rank_header.source
    with torch.no_grad():
        assert torch.equal(cut(input_ids=IDS).logits, direct(input_ids=IDS).logits)


@pytest.mark.pure
def test_tp1_build_equals_transformers(arch_work: Path, references: dict) -> None:
    """World size 1, no process group at all: the same layers at tp=1."""
    for name in ("llama_tied", "gemma3_text", "qwen3_moe"):
        model = build_model(arch_work / name / "tp1").eval()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=IDS).logits, references[name]["logits"], atol=LOGIT_ATOL, rtol=0)

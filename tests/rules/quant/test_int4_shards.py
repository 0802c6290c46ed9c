"""Int4 rank shards (GPTQ, AWQ, compressed-tensors pack-quantized) against the full checkpoint: each rank's
packed tensors are the checkpoint's own bytes at the indices the TP math gives it, and dequantize (by
tests/support/int4_ckpt.py, written from the formats' descriptions) to exactly its slice of the
dequantized full weight; merges give the checkpoint back byte for byte; misaligned splits are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.cli import main
from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.hf_checkpoint import merge
from reshard.testing.synth import llama_config
from tests.support.fp8_ckpt import write
from tests.support.int4_ckpt import (
    awq_qc,
    ct_qc,
    dequantize,
    dequantized_weights,
    format_of,
    gptq_qc,
    int4_checkpoint,
    local_groups,
    logical_index,
    modules,
    quantize,
    rank_groups,
    stored_index,
)
from tests.support.rank_files import differing_ranks, rank_file, same_bytes, written_ranks
from tests.support.tp_math import llama_rules

pytestmark = pytest.mark.pure

_BASE = {"hidden_size": 128, "num_attention_heads": 4, "head_dim": 32, "num_key_value_heads": 2,
         "intermediate_size": 256, "num_hidden_layers": 1, "vocab_size": 128}
# name -> (config, quantization_config): every format, its act order and channelwise variants, fused
# q/k/v and gate/up (phi3), q/k/v biases (qwen2); 2 kv heads, so tp=4 shares each kv head by 2 ranks
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "gptq": (llama_config(**_BASE), gptq_qc(32)),
    "gptq_act": (llama_config(model_type="qwen2", **_BASE), gptq_qc(32, desc_act=True, sym=False)),
    "gptq_channel": (llama_config(**_BASE), gptq_qc(-1)),
    "gptq_phi3": (llama_config(model_type="phi3", **_BASE), gptq_qc(32)),
    "awq": (llama_config(model_type="qwen2", **_BASE), awq_qc(32)),
    "awq_phi3": (llama_config(model_type="phi3", **_BASE), awq_qc(32)),
    "ct": (llama_config(**_BASE), ct_qc(32)),
    "ct_asym_phi3": (llama_config(model_type="phi3", **_BASE), ct_qc(32, sym=False)),
    "ct_channel": (llama_config(**_BASE), ct_qc(None, sym=False)),
    "ct_act": (llama_config(model_type="qwen2", **_BASE), ct_qc(32, sym=False, actorder="group")),
}
KIND_SUFFIX = {"gptq": "_gptq", "awq": "_awq", "ct": "_ct_int4"}


@pytest.fixture(scope="module")
def int4(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`int4(name)` -> the checkpoint of a case; `int4(name, tp)` -> its rank shards (each made once)."""
    root = tmp_path_factory.mktemp("int4")
    made: dict[tuple[str, int], Path] = {}

    def get(name: str, tp: int = 0) -> Path:
        if (name, 0) not in made:
            config, qc = CASES[name]
            made[(name, 0)] = int4_checkpoint(root / "root" / name, config, qc, seed=len(made))
        if tp and (name, tp) not in made:
            made[(name, tp)] = write(made[(name, 0)], tp, root / f"{name}-tp{tp}")
        return made[(name, tp)]

    return get


def take(t: torch.Tensor, index: list[torch.Tensor]) -> torch.Tensor:
    for d, idx in enumerate(index):
        t = t.index_select(d, idx)
    return t


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_its_units_and_dequantizes_to_its_slice(int4: Any, case: str, tp: int) -> None:
    cfg, qc = CASES[case]
    fmt = format_of(qc)[0]
    full = load_file(int4(case) / "model.safetensors")
    deq = dequantized_weights(int4(case), qc)
    mods = modules(full, fmt)
    assert len(mods) == (4 if "phi3" in case else 7)
    for rank in range(tp):
        local, desc = rank_file(int4(case, tp) / rank_file_name(rank, tp))
        assert set(local) == set(full)
        for stem, parts in mods.items():
            rows, cols = logical_index(stem, cfg, tp, rank)
            first = next(iter(parts.values()))
            held = rank_groups(qc, cols, (parts.get("scales", parts.get("weight_scale"))).shape[
                0 if fmt != "ct" else 1])
            mine = {}
            for suffix, t in parts.items():
                name = f"{stem}.{suffix}"
                want = take(t, stored_index(fmt, suffix, rows, cols, held, tuple(t.shape)))
                assert same_bytes(local[name], want), (case, tp, rank, name)
                assert desc[name]["kind"].endswith(KIND_SUFFIX[fmt]), (name, desc[name]["kind"])
                mine[suffix] = local[name]
            got = dequantize(fmt, mine, groups=local_groups(fmt, qc, mine, cols, held))
            assert torch.equal(got, deq[stem + ".weight"][rows][:, cols]), (case, tp, rank, stem)
            assert first.dtype == torch.int32
            bias = f"{stem}.bias"
            if bias in full:  # not a part: split as the column kind splits a bias
                assert same_bytes(local[bias], full[bias][rows]), (case, tp, rank, bias)
        assert desc["model.embed_tokens.weight"]["kind"] == "vocab_embed"  # not quantized: plain kinds
        assert desc["lm_head.weight"]["kind"] == "column"


@pytest.mark.parametrize("case", list(CASES))
def test_merge_returns_the_original_bytes(int4: Any, case: str, tmp_path: Path) -> None:
    for tp in (2, 4):
        out = tmp_path / f"tp{tp}"
        summary = merge(int4(case, tp), out, progress=False)
        assert summary["files"] == ["model.safetensors"]
        for fname in ("model.safetensors", "config.json"):
            assert (out / fname).read_bytes() == (int4(case) / fname).read_bytes(), (case, tp, fname)


def test_int4_shards_reshard_to_another_tp(int4: Any, tmp_path: Path) -> None:
    for case in ("gptq_act", "awq_phi3", "ct_asym_phi3"):
        assert differing_ranks(write(int4(case, 4), 2, tmp_path / case), int4(case, 2), 2) == [], case


RULES = llama_rules("_gptq", heads=4, kv_heads=2, options="group_size: 32")


def test_a_rules_file_says_the_same_explicitly(int4: Any, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    for tp in (2, 4):
        assert differing_ranks(write(int4("gptq"), tp, tmp_path / f"tp{tp}", "--rules", str(rules)),
                               int4("gptq", tp), tp) == [], tp


# (config, quantization_config, tp, the tensors named, what the error says, the tps it lists)
MISALIGNED = {
    # down_proj's K of 96 at tp=2: 48 inputs per rank cut a group of 32
    "group": (dict(intermediate_size=96), gptq_qc(32), 2, r"mlp\.down_proj\.(qweight|qzeros|scales|g_idx)",
              "the input (K) dim has 96 values and tp=2 puts a rank boundary at 48, inside one GPTQ group (32 values)",
              "{1,3}"),
    # act order keeps every group on every rank, and still the boundaries on group edges
    "act_order": (dict(intermediate_size=96), gptq_qc(32, desc_act=True), 2,
                  r"mlp\.down_proj\.(qweight|qzeros|scales|g_idx)", "puts a rank boundary at 48, inside one unit of 32",
                  "{1,3}"),
    # K of 96 at tp=4: 24 per rank, whole int32s of 8 but not whole AWQ groups of 32
    "awq_group": (dict(intermediate_size=96), awq_qc(32), 4, r"mlp\.down_proj\.(qweight|qzeros|scales)",
                  "tp=4 puts a rank boundary at 24, inside one AWQ group (32 values)", "{1,3}"),
    # k/v_proj's 8 rows at tp=2: 4 per rank cut an int32 of 8 zero points (asymmetric only)
    "zero_points": (dict(hidden_size=64, num_attention_heads=8, head_dim=4, num_key_value_heads=2,
                         intermediate_size=64), ct_qc(None, sym=False), 2,
                    r"self_attn\.[kv]_proj\.(weight_packed|weight_scale|weight_zero_point|weight_shape)",
                    "the output (N) dim has 8 values and tp=2 puts a rank boundary at 4, inside one compressed-tensors "
                    "int32 of packed zero points (8 values)", "{1}"),
}


@pytest.mark.parametrize("case", list(MISALIGNED))
def test_a_split_inside_a_unit_is_one_error_and_nothing_is_written(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    changes, qc, tp, tensors, says, works = MISALIGNED[case]
    src = int4_checkpoint(tmp_path / "ckpt", llama_config(**{**_BASE, **changes}), qc)
    out = tmp_path / "out"
    assert main(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("reshard: error: model.layers.0."), err
    assert __import__("re").search(tensors, err), err
    assert says in err and f"pick tp in {works}" in err, err
    assert not out.exists()
    for good in map(int, works.strip("{}").split(",")):  # the tps it lists split this module
        if good > 1 and (changes.get("num_attention_heads", 4) % good == 0):
            assert main(["write", str(src), "--tp", str(good), "-o", str(tmp_path / f"tp{good}"), "--no-progress"]) == 0


def test_symmetric_pack_quantized_has_no_zero_points_to_keep_whole(tmp_path: Path) -> None:
    """The case above without zero points (symmetric): 4 rows per rank are fine, and dequantize exactly."""
    cfg = llama_config(**{**_BASE, "hidden_size": 64, "num_attention_heads": 8, "head_dim": 4,
                          "num_key_value_heads": 2, "intermediate_size": 64})
    qc = ct_qc(None)
    src = int4_checkpoint(tmp_path / "ckpt", cfg, qc)
    out = write(src, 2, tmp_path / "tp2")
    full = load_file(src / "model.safetensors")
    deq = dequantized_weights(src, qc)
    stem = "model.layers.0.self_attn.k_proj"
    for rank in range(2):
        local, _ = rank_file(out / rank_file_name(rank, 2))
        rows = torch.arange(4 * rank, 4 * rank + 4)
        assert same_bytes(local[stem + ".weight_packed"], full[stem + ".weight_packed"][rows])
        t = {s: local[f"{stem}.{s}"] for s in ("weight_packed", "weight_scale")}
        got = dequantize("ct", t, groups=torch.zeros(64, dtype=torch.long))
        assert torch.equal(got, deq[stem + ".weight"][rows])


def test_unquantized_modules_keep_their_plain_rule(tmp_path: Path) -> None:
    """A module left out of quantization (`modules_to_not_convert` / `ignore`): its weight keeps the plain
    kind; the quantized modules of the same rule get the twin."""
    cfg, qc = CASES["awq"]
    kept = "model.layers.0.mlp.down_proj.weight"
    src = int4_checkpoint(tmp_path / "ckpt", cfg, {**qc, "modules_to_not_convert": ["down_proj"]}, keep=(kept,))
    full = load_file(src / "model.safetensors")
    ranks = written_ranks(src, 2, tmp_path / "tp2")
    assert [(d[kept]["kind"], t[kept].dtype) for t, d in ranks] == [("row", torch.bfloat16)] * 2
    assert all(torch.equal(t[kept], w) for (t, _), w in zip(ranks, full[kept].chunk(2, dim=1)))
    for _, desc in ranks:  # the module's twin (its tensors), and the plain rule for its bias
        assert desc["model.layers.0.self_attn.o_proj.qweight"]["kind"] == "row_awq"
        assert desc["model.layers.0.self_attn.q_proj.bias"]["kind"] == "column"


def test_a_quantized_lm_head_splits_its_vocabulary_in_whole_int32s(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """GPTQ with `lm_head: true` and a vocabulary of 1000: transformers' cut (500 rows a rank) would cut an
    int32 of zero points and is refused; vLLM's (padded to 1024, 512 a rank) holds whole int32s, zeros past
    the vocabulary."""
    cfg = llama_config(**{**_BASE, "vocab_size": 1000})
    src = int4_checkpoint(tmp_path / "ckpt", cfg, {**gptq_qc(32), "lm_head": True})
    state = load_file(src / "model.safetensors")  # quantize lm_head too, as GPTQ's lm_head option does
    for suffix, t in quantize("gptq", state.pop("lm_head.weight"), group=32).items():
        state[f"lm_head.{suffix}"] = t
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert main(["write", str(src), "--tp", "2", "-o", str(tmp_path / "hf"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "lm_head." in err and "the output (N) dim has 1000 values and tp=2 puts a rank boundary at 500" in err
    out = write(src, 2, tmp_path / "vllm", "--engine", "vllm")
    for rank in range(2):
        local, desc = rank_file(out / rank_file_name(rank, 2))
        rows = torch.arange(512 * rank, 512 * rank + 512)
        real = rows[rows < 1000]
        qweight, scales, qzeros = (local[f"lm_head.{s}"] for s in ("qweight", "scales", "qzeros"))
        assert desc["lm_head.qweight"]["kind"] == "column_gptq" and qweight.shape == (16, 512)
        assert torch.equal(qweight[:, : len(real)], state["lm_head.qweight"][:, real])
        assert torch.equal(scales[:, : len(real)], state["lm_head.scales"][:, real])
        assert torch.equal(qzeros[:, : len(real) // 8], state["lm_head.qzeros"][:, real[::8] // 8])
        assert not qweight[:, len(real):].any() and not qzeros[:, len(real) // 8:].any()  # padding: zeros

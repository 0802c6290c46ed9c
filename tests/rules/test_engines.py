"""Engine cuts (reshard.rules.engines): a vocabulary cut the way vLLM holds it, shared experts split,
the plans from the shipped table whatever transformers is installed, and the vLLM plugin's checks of the
rank files and its options (all without vLLM: those parts import none of it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard.rules.tp_plans as tp_plans
from reshard.cli import main
from reshard.errors import CheckpointError, RegistryError, ReshardError
from reshard.fill.into_params import read_header_from
from reshard.integrations.vllm.fill import _check_header
from reshard.integrations.vllm.options import loader_options
from reshard.rules.engines import apply_engine
from reshard.rules.from_config import from_config
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.fp8_ckpt import ct_qc, fp8_checkpoint, write

pytestmark = pytest.mark.pure

H = 64


def vllm_vocab_rows(vocab: int, rank: int, tp: int) -> tuple[int, int]:
    """The rows vLLM's VocabParallelEmbedding holds on `rank` (its own formula, restated): the vocabulary
    padded to a multiple of 64, split evenly; (first row, rows holding real data)."""
    padded = (vocab + 63) // 64 * 64
    per = padded // tp
    start = rank * per
    return start, max(0, min(per, vocab - start))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = llama_config(vocab_size=1000, hidden_size=H, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2)
    return make_checkpoint(tmp_path_factory.mktemp("layout") / "ckpt", config, seed=5)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_cut_of_the_vocabulary_is_how_vllm_holds_it(ckpt: Path, tmp_path: Path, tp: int) -> None:
    out = tmp_path / "shards"
    assert main(["write", str(ckpt), "--tp", str(tp), "--engine", "vllm", "-o", str(out), "--no-progress"]) == 0
    full = load_file(ckpt / "model.safetensors")
    padded = (1000 + 63) // 64 * 64  # 1024
    for rank in range(tp):
        shard = load_file(out / f"rank-{rank:05d}-of-{tp:05d}.safetensors")
        start, real = vllm_vocab_rows(1000, rank, tp)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            got = shard[name]
            assert got.shape == (padded // tp, H)
            assert torch.equal(got[:real], full[name][start : start + real])
            assert not got[real:].any()  # vLLM zeroes the rows past the vocabulary
        q = shard["model.layers.0.self_attn.q_proj.weight"]  # everything else as transformers cuts it
        assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"].chunk(tp)[rank])


def test_default_cut_differs_and_vocab_at_tp_not_dividing_padded_size_is_refused(ckpt: Path, tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["write", str(ckpt), "--tp", "2", "-o", str(tmp_path / "plain"), "--no-progress"]) == 0
    assert load_file(tmp_path / "plain" / "rank-00000-of-00002.safetensors")["model.embed_tokens.weight"].shape == (500, H)
    rc = main(["plan", str(ckpt), "--tp", "3", "--engine", "vllm"])
    err = capsys.readouterr().err
    assert rc != 0 and "padded to 1024 (a multiple of align=64), not divisible by tp=3" in err


def test_vllm_cut_splits_shared_experts_and_unknown_engines_are_named() -> None:
    config = {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_experts": 4, "vocab_size": 1000}
    names = ["model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert.down_proj.weight",
             "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
             "model.embed_tokens.weight", "lm_head.weight"]
    plain = from_config(config, names)
    vllm = apply_engine(plain, "vllm", names)
    assert len(apply_engine(plain, "vllm", names[2:]).rules) == len(plain.rules)  # no shared expert: no rule
    kinds = {n: (r.kind, r.options.get("align")) if (r := vllm.match(n)) else None for n in names}
    assert plain.match(names[0]) is None  # transformers' plans replicate the shared expert
    assert kinds == {names[0]: ("column", None), names[1]: ("row", None), names[2]: None,
                     names[3]: ("column", None), names[4]: ("vocab_embed", 64), names[5]: ("column", 64)}
    assert vllm.digest() != plain.digest() and vllm.source.endswith(", cut for vllm")
    with pytest.raises(RegistryError, match="unknown engine 'sglang'; known engines: vllm"):
        apply_engine(plain, "sglang")


def test_plans_come_from_the_shipped_table_whatever_transformers_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older transformers beside reshard (vLLM pins one) must not change what a rank gets: the default
    never reads it (5.19's live plan for qwen2_moe replicates every expert; the 5.24 table splits them)."""
    monkeypatch.delenv(tp_plans.SOURCE_ENV, raising=False)
    monkeypatch.setattr(tp_plans, "transformers_version", lambda: "5.19.0")

    def no_live(model_type: str) -> None:
        raise AssertionError("the installed transformers was read")

    monkeypatch.setattr(tp_plans, "live_entry", no_live)
    manifest = from_config({"model_type": "qwen2_moe", "num_attention_heads": 4, "num_key_value_heads": 2},
                           ["model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"])
    assert [r.kind for r in manifest.rules] == ["column", "row"]
    assert manifest.source.startswith("shipped plan table (transformers 5.24")
    monkeypatch.setenv(tp_plans.SOURCE_ENV, "live")  # asked for: the installed one is read
    with pytest.raises(AssertionError, match="installed transformers was read"):
        from_config({"model_type": "qwen2_moe"}, ["model.layers.0.mlp.experts.1.gate_proj.weight"])


def _header(path: Path) -> object:
    return read_header_from(iter([path.read_bytes()]), str(path))[0]


def test_plugin_refuses_rank_files_of_another_cut_or_tp(ckpt: Path, tmp_path: Path) -> None:
    assert main(["write", str(ckpt), "--tp", "2", "-o", str(tmp_path / "plain"), "--no-progress"]) == 0
    assert main(["write", str(ckpt), "--tp", "2", "--engine", "vllm", "-o", str(tmp_path / "v"), "--no-progress"]) == 0
    plain = _header(tmp_path / "plain" / "rank-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"lm_head.weight was cut with transformers' vocabulary split.*"
                                              r"reshard write CKPT --tp 2 --engine vllm -o DIR"):
        _check_header(plain, 1, 2, "plain")
    good = _header(tmp_path / "v" / "rank-00001-of-00002.safetensors")
    _check_header(good, 1, 2, "v")  # the vLLM cut, the right rank: accepted
    with pytest.raises(CheckpointError, match=r"is the shard of rank 1 of tp=2, but this vLLM worker is rank 1 of "
                                              r"tensor_parallel_size=4"):
        _check_header(good, 1, 4, "v")


def test_plugin_options_are_checked() -> None:
    assert loader_options({"url": "http://h:1/v1/checkpoints/x", "token": "t"})["token"] == "t"
    with pytest.raises(ReshardError, match=r"unknown keys \['shard'\]; known: url, shards, token, rules"):
        loader_options({"shard": "/x"})
    with pytest.raises(ReshardError, match="needs exactly one of"):
        loader_options({"url": "http://h:1/v1/checkpoints/x", "shards": "/x"})
    with pytest.raises(ReshardError, match="needs exactly one of"):
        loader_options(None)
    with pytest.raises(ReshardError, match=r"\['rules'\] must be a string"):
        loader_options({"shards": "/x", "rules": 3})


def test_plugin_refuses_fp8_shards(tmp_path: Path) -> None:
    config = llama_config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2)
    src = fp8_checkpoint(tmp_path / "fp8", config, ct_qc("channel"))
    out = write(src, 2, tmp_path / "v", "--engine", "vllm")
    with pytest.raises(CheckpointError, match=r"is FP8; load_format='reshard' loads unquantized checkpoints only"):
        _check_header(_header(out / "rank-00000-of-00002.safetensors"), 0, 2, "fp8")


def test_plugin_refuses_shards_of_another_tp_or_cut_before_touching_the_model(ckpt: Path, tmp_path: Path) -> None:
    """`fill_vllm_model` checks the shards before it looks at vLLM's model (here: none at all)."""
    from reshard.integrations.vllm.fill import fill_vllm_model

    out = tmp_path / "v2"
    assert main(["write", str(ckpt), "--tp", "2", "--engine", "vllm", "-o", str(out), "--no-progress"]) == 0
    with pytest.raises(CheckpointError, match=r"no rank-00000-of-00001.safetensors for tp=1 \(the rank files here are of "
                                              r"worlds of \[2\] ranks\); run `reshard write"):
        fill_vllm_model(None, out, rank=0, tp=1)  # type: ignore[arg-type]
    assert main(["write", str(ckpt), "--pp", "2", "--engine", "vllm", "-o", str(tmp_path / "pp2"), "--no-progress"]) == 0
    with pytest.raises(CheckpointError, match=r"is a shard of pp=2 x tp=1; vLLM workers load tensor-parallel shards"):
        fill_vllm_model(None, tmp_path / "pp2", rank=0, tp=2)  # type: ignore[arg-type]
    assert main(["write", str(ckpt), "--tp", "2", "-o", str(tmp_path / "plain"), "--no-progress"]) == 0
    with pytest.raises(CheckpointError, match="lm_head.weight was cut with transformers' vocabulary split"):
        fill_vllm_model(None, tmp_path / "plain", rank=1, tp=2)  # type: ignore[arg-type]
    (out / "rank-00001-of-00002.safetensors").rename(out / "rank-00000-of-00001.safetensors")
    with pytest.raises(CheckpointError, match="is the shard of rank 1 of tp=2, but this vLLM worker is rank 0 of "
                                              "tensor_parallel_size=1"):
        fill_vllm_model(None, out, rank=0, tp=1)  # type: ignore[arg-type]


def test_vllm_cut_splits_gpt_oss_attention_by_heads() -> None:
    """transformers' gpt-oss plan replicates attention; vLLM splits q and the sinks by heads, k/v by kv heads
    (each shared by tp / kv ranks past that), o by its input."""
    config = {"model_type": "gpt_oss", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 4,
              "hidden_size": 32, "intermediate_size": 64, "num_local_experts": 2, "vocab_size": 128}
    a = "model.layers.0.self_attn."
    names = [a + "q_proj.weight", a + "k_proj.bias", a + "o_proj.weight", a + "o_proj.bias", a + "sinks"]
    plain = from_config(config, names)
    assert [plain.match(n) for n in names] == [None] * 5
    vllm = apply_engine(plain, "vllm", names, config)
    got = {n.removeprefix(a): (r.kind, r.options) if (r := vllm.match(n)) else None for n in names}
    assert got == {"q_proj.weight": ("column", {"heads": 8}), "k_proj.bias": ("column", {"heads": 2, "replicate_heads": True}),
                   "o_proj.weight": ("row", {}), "o_proj.bias": None, "sinks": ("column", {"heads": 8})}
    assert apply_engine(plain, "vllm", names[:4], config).rules == apply_engine(plain, "vllm", [], config).rules

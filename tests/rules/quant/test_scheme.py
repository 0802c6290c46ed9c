"""Quantization schemes as values (`reshard.rules.quant.scheme.QuantScheme`): FP8 names its kinds and
its companion tensors, its kinds are registered from it, and code asks a scheme (so a second packed
format with other names is recognised by its own suffixes, never by `_fp8`)."""

from __future__ import annotations

import pytest

from reshard.errors import RegistryError
from reshard.rules.kinds import known_kinds, layer_factory
from reshard.rules.manifest import Rule
from reshard.rules.quant.fp8_kinds import base_kind, quantized_kind
from reshard.rules.quant.rules import FollowRule, quantized_weights
from reshard.rules.quant.scheme import FP8, QuantScheme, register_scheme, scheme_from_config, scheme_of_kind

pytestmark = pytest.mark.pure

INT4 = QuantScheme("int4", "_int4", bases=("column",), scale_suffixes=(".scales",), replicated_suffixes=(".g_idx",),
                   torch_dtypes=("int32",))


def test_fp8_names_its_kinds_and_companions() -> None:
    assert [FP8.kind(b) for b in FP8.bases] == ["column_fp8", "row_fp8", "packed_column_fp8", "vocab_embed_fp8",
                                                "replicate_fp8"]
    assert {FP8.kind(b) for b in FP8.bases} <= set(known_kinds())
    assert all(layer_factory(FP8.kind(b)) is not None for b in FP8.bases if b != "replicate")
    assert FP8.companions == (".weight_scale_inv", ".weight_scale", ".input_scale")
    assert (FP8.base_of("packed_column_fp8"), FP8.base_of("column")) == ("packed_column", None)
    assert FP8.weight_of("m.q.weight_scale_inv") == "m.q.weight" and FP8.weight_of("m.q.bias") is None
    assert (scheme_of_kind("row_fp8"), scheme_of_kind("row")) == (FP8, None)
    assert (base_kind("vocab_embed_fp8"), base_kind("row"), quantized_kind("row"), quantized_kind("row_fp8")) == \
        ("vocab_embed", "row", "row_fp8", "row_fp8")


def test_a_checkpoint_scheme_names_its_packed_format() -> None:
    scheme = scheme_from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}})
    assert scheme is not None and (scheme.block, scheme.packed) == ((64, 32), FP8)


def test_a_second_format_is_asked_not_suffix_tested() -> None:
    names = ["a.weight", "a.scales", "b.weight", "b.weight_scale", "c.weight"]
    assert quantized_weights(names, INT4) == frozenset({"a.weight"})
    assert quantized_weights(names) == frozenset({"b.weight"})
    assert (INT4.kind("column"), INT4.base_of("column_int4"), INT4.weight_of("a.g_idx")) == \
        ("column_int4", "column", "a.weight")
    with pytest.raises(RegistryError, match="quantization scheme 'fp8' is already registered"):
        register_scheme(FP8)


def test_a_twin_matches_its_weights_and_their_companions_only() -> None:
    rule = FollowRule("*", "column_fp8", {"block": [128, 128]}, False, frozenset({"m.q.weight"}))
    got = [n for n in ["m.q.weight", "m.q.weight_scale_inv", "m.q.input_scale", "m.k.weight", "m.q.bias"]
           if rule.matches(n)]
    assert got == ["m.q.weight", "m.q.weight_scale_inv", "m.q.input_scale"]
    assert rule.to_dict() == Rule("*", "column_fp8", {"block": [128, 128]}).to_dict()

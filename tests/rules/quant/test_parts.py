"""Packed formats described by their parts (`reshard.rules.quant.parts`): every tensor of a quantized
module is split where its base kind splits the module's logical weight, in its own units, against the
selection torch.chunk gives the logical weight."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from reshard.errors import PlanError
from reshard.format.selection import Selection
from reshard.rules.kinds import tensor_selection
from reshard.rules.manifest import Rule
from reshard.rules.quant.parts import register_part_kinds, stored_units
from reshard.rules.quant.rules import FollowRule, quantized_rules, quantized_weights
from reshard.rules.quant.scheme import Axis, Part, QuantScheme, Scheme, register_quant_method

pytestmark = pytest.mark.pure

# a toy 4-bit format: `X.qw` [N, K/2] (2 values per byte along K), `X.s` [N, K/g], `X.gs` a scalar,
# `X.zp` [N/8, K/g] (zero points packed 8 per int32 along N), `X.idx` [K] (an input permutation)
TOY = register_part_kinds(QuantScheme(
    "toy4", "_toy4", bases=("column", "row", "packed_column", "expert_column", "expert_row", "replicate"),
    scale_suffixes=(".s",), replicated_suffixes=(".gs",), torch_dtypes=("uint8",), weight_suffix=".qw",
    parts=(Part(".qw", (Axis(-2), Axis(-1, 2, "byte of 2 values"))),
           Part(".s", (Axis(-2), Axis(-1, "group_size", "group"))),
           Part(".zp", (Axis(-2, 8, "int32 of 8 zero points"), Axis(-1, "group_size", "group"))),
           Part(".idx", (Axis(-1),)),
           Part(".gs", None))))


@register_quant_method("toy4")
def _toy(qc: dict) -> Scheme:
    return Scheme("toy4", None, TOY, (("group_size", qc["group_size"]),))


G = 4
OPTS = {"group_size": G}


@pytest.fixture(scope="module", autouse=True)
def _unregister_toy() -> Iterator[None]:
    """The toy format is this module's: its kinds, scheme and quant_method leave with it (the suite's
    other tests see the shipped registry)."""
    yield
    from reshard.rules import kinds as loaders
    from reshard.rules.quant import scheme

    for kind in [k for k in loaders._REGISTRY if TOY.base_of(k) is not None]:
        del loaders._REGISTRY[kind]
    scheme._SCHEMES.pop(TOY.name, None)
    scheme._METHODS.pop("toy4", None)


def sel(name: str, shape: tuple[int, ...], kind: str, tp: int, rank: int, **options: object) -> Selection:
    return tensor_selection(name, shape, Rule("*", kind, {**OPTS, **options}), rank, tp)


def pick(t: torch.Tensor, s: Selection) -> torch.Tensor:
    for d, ivs in enumerate(s):
        t = t.index_select(d, torch.cat([torch.arange(a, b) for a, b in ivs]))
    return t


def stored_of(logical: torch.Tensor, dim: int, unit: int) -> torch.Tensor:
    """The stored indices a set of logical indices (along one dim) lives in."""
    return torch.unique(logical // unit)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind,split", [("column_toy4", -2), ("row_toy4", -1)])
def test_each_part_takes_the_units_of_its_ranks_logical_slice(kind: str, split: int, tp: int) -> None:
    n, k = 32, 64
    idx = {-2: torch.arange(n), -1: torch.arange(k)}
    for rank in range(tp):
        mine = {d: (torch.chunk(v, tp)[rank] if d == split else v) for d, v in idx.items()}
        for suffix, shape, units in ((".qw", (n, k // 2), (1, 2)), (".s", (n, k // G), (1, G)),
                                     (".zp", (n // 8, k // G), (8, G))):
            got = pick(torch.arange(shape[0] * shape[1]).reshape(shape), sel("m.x" + suffix, shape, kind, tp, rank))
            want = torch.arange(shape[0] * shape[1]).reshape(shape)
            want = want[stored_of(mine[-2], 0, units[0])][:, stored_of(mine[-1], 1, units[1])]
            assert torch.equal(got, want), (suffix, rank)
        assert sel("m.x.idx", (k,), kind, tp, rank) == ((tuple(_runs(mine[-1])),))
        assert sel("m.x.gs", (1,), kind, tp, rank) == (((0, 1),),)


def _runs(v: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(v[0]), int(v[-1]) + 1)]


def test_a_split_inside_a_unit_is_refused_naming_the_unit_and_the_tps_that_work() -> None:
    # K = 48: groups of 4 -> tp 1,2,3,4,6,12 keep whole groups; 8 puts a boundary at 6, inside a group
    with pytest.raises(PlanError) as e:
        sel("m.x.qw", (16, 24), "row_toy4", 8, 1)
    msg = str(e.value)
    assert msg.startswith("m.x.qw: the input (K) dim has 48 values and tp=8 puts a rank boundary at 6, inside one group")
    assert "group (4 values)" in msg and "pick tp in {1,2,3,4,6,12}" in msg and "kind row_toy4" in msg
    # the zero points' packing along N: 8 rows per int32, so N = 32 splits only into 1, 2 or 4
    with pytest.raises(PlanError, match=r"output \(N\) dim has 32 values .* int32 of 8 zero points .* pick tp in \{1,2,4\}"):
        sel("m.x.zp", (4, 4), "column_toy4", 8, 0)
    # every tensor of the module refuses the same split: the weight itself says the scale's unit
    with pytest.raises(PlanError, match="inside one group"):
        sel("m.x.qw", (16, 24), "row_toy4", 8, 0)


def test_experts_lead_and_a_rule_unit_adds_a_constraint() -> None:
    e, n, k = 4, 16, 32
    for rank in range(2):
        got = sel("m.x.qw", (e, n, k // 2), "expert_column_toy4", 2, rank)
        assert got == (((0, e),), ((rank * n // 2, (rank + 1) * n // 2),), ((0, k // 2),))
        got = sel("m.x.s", (e, n, k // G), "expert_row_toy4", 2, rank)
        assert got == (((0, e),), ((0, n),), ((rank * k // G // 2, (rank + 1) * k // G // 2),))
    with pytest.raises(PlanError, match=r"inside one unit of 16 \(rule option `unit`\).*pick tp in \{1\}"):
        sel("m.x.qw", (e, n, k // 2), "expert_column_toy4", 2, 0, unit=[16, None])


def test_a_missing_option_and_a_packed_column_split() -> None:
    with pytest.raises(PlanError, match="option group_size=None must be a positive integer"):
        tensor_selection("m.x.s", (8, 2), Rule("*", "row_toy4"), 0, 2)
    blocks = {"blocks": [32, 16, 16]}  # fused q|k|v along N, each block split on its own
    got = sel("m.x.zp", (8, 8), "packed_column_toy4", 2, 1, **blocks)
    assert got == (((2, 4), (5, 6), (7, 8)), ((0, 8),))
    assert sel("m.x.idx", (32,), "packed_column_toy4", 2, 1, **blocks) == (((0, 32),),)
    with pytest.raises(PlanError, match=r"boundary at 20, inside one int32 of 8 zero points .* pick tp in \{1\}"):
        sel("m.x.zp", (4, 8), "packed_column_toy4", 2, 1, blocks=[16, 8, 8])
    assert stored_units(TOY, ".zp", 3, OPTS) == [(-3, 1), (-2, 8), (-1, G)]


def test_twins_follow_the_modules_logical_name() -> None:
    names = ["m.q.qw", "m.q.s", "m.q.gs", "m.q.idx", "m.q.bias", "m.o.qw", "m.o.s", "m.n.weight"]
    assert quantized_weights(names, TOY) == frozenset({"m.q.qw", "m.o.qw"})
    config = {"quantization_config": {"quant_method": "toy4", "group_size": 4}}
    rules = [Rule("m.q.weight", "column"), Rule("m.o.*", "row"), Rule("m.q.bias", "column")]
    out = quantized_rules(rules, config, names)
    assert [(r.pattern, r.kind, r.options) for r in out] == [
        ("m.q.weight", "column_toy4", {"group_size": 4}), ("m.o.*", "row_toy4", {"group_size": 4}),
        ("m.q.bias", "column", {})]
    assert isinstance(out[0], FollowRule)
    assert [n for n in names if out[0].matches(n)] == ["m.q.qw", "m.q.s", "m.q.gs", "m.q.idx"]
    assert TOY.logical_name("m.q.zp") == "m.q.weight" and TOY.weight_of("m.q.gs") == "m.q.qw"

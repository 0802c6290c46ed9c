"""An optimizer moment of a training checkpoint (`NAME.exp_avg`, `NAME.exp_avg_sq`) is cut as its parameter
`NAME` is, whatever the kind decides from the parameter's name (a row rule replicates a bias): found resuming a
llama with `attention_bias` at another layout (docs/trainer-vs-transformers.md)."""

from __future__ import annotations

import pytest

from reshard.format.rank_file import OPTIMIZER_SLOTS, optimizer_tensor_name
from reshard.format.selection import full_selection
from reshard.rules.kinds import tensor_selection
from reshard.rules.manifest import Rule

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("kind", ["row", "column", "replicate"])
@pytest.mark.parametrize("param,shape", [("model.layers.0.self_attn.o_proj.bias", (64,)),
                                         ("model.layers.0.self_attn.o_proj.weight", (64, 32))])
def test_a_moment_is_cut_as_its_parameter(kind: str, param: str, shape: tuple[int, ...]) -> None:
    for tp in (1, 2, 4):
        for rank in range(tp):
            expected = tensor_selection(param, shape, Rule(param, kind), rank, tp)
            for slot in OPTIMIZER_SLOTS:
                name = optimizer_tensor_name(param, slot)
                assert tensor_selection(name, shape, Rule(name, kind), rank, tp) == expected, (name, rank, tp)


def test_a_row_bias_moment_is_replicated() -> None:
    name = optimizer_tensor_name("model.layers.0.self_attn.o_proj.bias", "exp_avg")
    assert [tensor_selection(name, (64,), Rule(name, "row"), r, 2) for r in range(2)] == [full_selection((64,))] * 2

"""TP at world size 1 with no process group at all; meta construction; errors and reprs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import reshard.tp.layers as tp_layers
from reshard.errors import PlanError
from reshard.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    tp_rank,
    tp_world_size,
    vocab_parallel_cross_entropy,
)

pytestmark = pytest.mark.pure

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests must run without a process group"


def test_helpers_without_process_group() -> None:
    assert tp_world_size() == 1
    assert tp_rank() == 0


@pytest.mark.parametrize(
    "op", [copy_to_tp_region, reduce_from_tp_region, gather_from_tp_region, scatter_to_tp_region]
)
def test_ops_are_identity(op) -> None:
    x = torch.randn(2, 3, 5, requires_grad=True)
    y = op(x)
    g = torch.randn(2, 3, 5)
    y.backward(g)
    assert torch.equal(y, x)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "make",
    [
        lambda b: ColumnParallelLinear(4, 6, bias=b),
        lambda b: ColumnParallelLinear(4, 6, bias=b, gather_output=True),
        lambda b: RowParallelLinear(4, 6, bias=b),
        lambda b: RowParallelLinear(4, 6, bias=b, input_is_parallel=False),
    ],
)
def test_linear_layers_equal_nn_linear(make, bias: bool) -> None:
    ref = nn.Linear(4, 6, bias=bias)
    layer = make(bias)
    layer.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 3, 4)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x_ref), layer(x_par)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, **TOL)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **TOL)


def test_init_matches_torch_at_tp1() -> None:
    torch.manual_seed(0)
    ref_lin, ref_emb = nn.Linear(5, 7), nn.Embedding(9, 3)
    torch.manual_seed(0)
    col, emb = ColumnParallelLinear(5, 7), VocabParallelEmbedding(9, 3)
    torch.manual_seed(0)
    row = RowParallelLinear(5, 7)
    assert torch.equal(col.weight, ref_lin.weight) and torch.equal(col.bias, ref_lin.bias)
    assert torch.equal(row.weight, ref_lin.weight) and torch.equal(row.bias, ref_lin.bias)
    assert torch.equal(emb.weight, ref_emb.weight)


def test_embedding_and_padded_layers_at_tp1() -> None:
    ref = nn.Embedding(7, 3)
    emb = VocabParallelEmbedding(7, 3, padded_num_embeddings=8)
    assert emb.weight.shape == (8, 3) and torch.all(emb.weight[7] == 0)
    emb.load_state_dict({"weight": torch.cat([ref.weight.detach(), torch.zeros(1, 3)])}, strict=True)
    ids = torch.tensor([[0, 6, 3, 6]])
    torch.testing.assert_close(emb(ids), ref(ids), **TOL)

    head = ColumnParallelLinear(3, 7, padded_out_features=8, gather_output=True)
    assert head.weight.shape == (8, 3) and torch.all(head.weight[7] == 0) and head.bias[7] == 0
    lin = nn.Linear(3, 7)
    head.load_state_dict(
        {
            "weight": torch.cat([lin.weight.detach(), torch.zeros(1, 3)]),
            "bias": torch.cat([lin.bias.detach(), torch.zeros(1)]),
        }
    )
    x = torch.randn(2, 3)
    torch.testing.assert_close(head(x), lin(x), **TOL)  # gathered output trimmed to out_features
    head.gather_output = False
    assert head(x).shape == (2, 8)


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_cross_entropy_at_tp1(ignore_index: int) -> None:
    logits = torch.randn(3, 4, 6) * 5
    labels = torch.randint(0, 6, (3, 4))
    labels[0, 0] = labels[2, 1] = ignore_index
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = F.cross_entropy(a.reshape(-1, 6), labels.reshape(-1), ignore_index=ignore_index)
    out = vocab_parallel_cross_entropy(b, labels, ignore_index=ignore_index)
    ref.backward()
    out.backward()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(b.grad, a.grad, **TOL)


def test_cross_entropy_padded_vocab_and_dtypes_at_tp1() -> None:
    logits = torch.randn(4, 6)
    logits[:, 5] = 100.0  # padded column
    labels = torch.tensor([0, 4, -100, 2])
    a = logits[:, :5].clone().requires_grad_()
    ref = F.cross_entropy(a, labels)
    ref.backward()
    b = logits.clone().to(torch.bfloat16).requires_grad_()
    out = vocab_parallel_cross_entropy(b, labels, vocab_size=5)
    out.backward()
    assert out.dtype == torch.float32 and b.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.02)
    assert torch.all(b.grad[:, 5] == 0)


def test_cross_entropy_bad_inputs() -> None:
    with pytest.raises(ValueError, match="labels shape"):
        vocab_parallel_cross_entropy(torch.randn(2, 3, 5), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size=6"):
        vocab_parallel_cross_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), vocab_size=6)
    # a label that no rank holds is a NaN loss, not a silently wrong number
    assert torch.isnan(vocab_parallel_cross_entropy(torch.randn(2, 5), torch.tensor([1, 7])))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_meta_construction_allocates_nothing() -> None:
    before = _rss_bytes()
    # ~ 64 GiB of fp32 parameters if they were real
    layers = [
        ColumnParallelLinear(16384, 262144, device="meta"),
        RowParallelLinear(262144, 16384, device="meta"),
        VocabParallelEmbedding(262144, 16384, padded_num_embeddings=262144, device="meta"),
    ]
    grown = _rss_bytes() - before
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("make", "ref_sd"),
    [
        (lambda: ColumnParallelLinear(4, 6, device="meta"), lambda: nn.Linear(4, 6).state_dict()),
        (
            lambda: RowParallelLinear(4, 6, bias=False, device="meta"),
            lambda: nn.Linear(4, 6, bias=False).state_dict(),
        ),
        (
            lambda: VocabParallelEmbedding(6, 4, device="meta", dtype=torch.float64),
            lambda: nn.Embedding(6, 4, dtype=torch.float64).state_dict(),
        ),
    ],
)
def test_meta_to_empty_then_load(make, ref_sd, monkeypatch: pytest.MonkeyPatch) -> None:
    layer, sd = make(), ref_sd()
    calls = []
    monkeypatch.setattr(type(layer), "reset_parameters", lambda self: calls.append(self))
    layer.to_empty(device="cpu")
    layer.load_state_dict(sd, strict=True)
    assert not calls, "to_empty must not re-initialize"
    for name, t in layer.state_dict().items():
        assert not t.is_meta and torch.equal(t, sd[name]), name


def test_non_divisible_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp_layers, "tp_world_size", lambda group=None: 4)
    monkeypatch.setattr(tp_layers, "tp_rank", lambda group=None: 1)
    with pytest.raises(
        PlanError,
        match=r"ColumnParallelLinear: out_features=10 is not divisible by tp=4; pass padded_out_features=12",
    ):
        ColumnParallelLinear(8, 10, device="meta")
    with pytest.raises(
        PlanError,
        match=r"RowParallelLinear: in_features=10 is not divisible by tp=4; pick tp in \{1, 2, 5, 10\}",
    ):
        RowParallelLinear(10, 8, device="meta")
    with pytest.raises(PlanError, match=r"padded_num_embeddings=30 is not divisible by tp=4; use 32"):
        VocabParallelEmbedding(29, 8, padded_num_embeddings=30, device="meta")
    layer = VocabParallelEmbedding(32001, 8, padded_num_embeddings=32004, device="meta")
    assert (layer.weight.shape[0], layer.vocab_start_index, layer.vocab_end_index) == (8001, 8001, 16002)


def test_plan_errors_at_tp1() -> None:
    with pytest.raises(PlanError, match="padded_out_features=5 is smaller than out_features=6"):
        ColumnParallelLinear(4, 6, padded_out_features=5)
    with pytest.raises(PlanError, match="num_embeddings=0 must be positive"):
        VocabParallelEmbedding(0, 4)


def test_attributes_and_repr() -> None:
    col = ColumnParallelLinear(4, 6, gather_output=True, device="meta")
    row = RowParallelLinear(6, 4, bias=False, input_is_parallel=False, device="meta")
    emb = VocabParallelEmbedding(7, 3, padded_num_embeddings=8, device="meta")
    assert (col.in_features, col.out_features, col.tp, col.rank, col.group) == (4, 6, 1, 0, None)
    assert (row.in_features, row.out_features, row.local_in_features) == (6, 4, 6)
    assert repr(col) == (
        "ColumnParallelLinear(in_features=4, out_features=6, bias=True, gather_output=True, tp=1, "
        "rank=0, local_out_features=6)"
    )
    assert "input_is_parallel=False" in repr(row) and "bias=False" in repr(row)
    assert repr(emb) == (
        "VocabParallelEmbedding(num_embeddings=7, embedding_dim=3, padded_num_embeddings=8, tp=1, "
        "rank=0, rows=[0, 8))"
    )

"""Checks of the parallel layers, the MLP block and the vocab-parallel loss (see tp_checks.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from reshard.errors import PlanError
from reshard.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tests.support.tp_checks import all_gather_list, check, close, leaf, linear, randn, shard_state


@check
def check_column_parallel_linear(rank: int, ws: int) -> None:
    for bias in (True, False):
        for gather in (False, True):
            what = f"ColumnParallelLinear(bias={bias}, gather_output={gather})"
            ref = linear(1, 6, 8, bias)
            layer = ColumnParallelLinear(6, 8, bias=bias, gather_output=gather)
            layer.load_state_dict(shard_state(ref.state_dict(), "column", ws, rank), strict=True)
            x, g = randn(2, 2, 3, 6), randn(3, 2, 3, 8)
            x_ref, x_par = leaf(x), leaf(x)
            y_ref = ref(x_ref)
            (y_ref * g).sum().backward()
            y = layer(x_par)
            want_y, g_par = (
                (y_ref, g) if gather else (torch.chunk(y_ref, ws, -1)[rank], torch.chunk(g, ws, -1)[rank])
            )
            (y * g_par).sum().backward()
            close(y.detach(), want_y.detach(), f"{what} output")
            close(x_par.grad, x_ref.grad, f"{what} input gradient")
            close(layer.weight.grad, torch.chunk(ref.weight.grad, ws, 0)[rank], f"{what} weight gradient")
            if bias:
                close(layer.bias.grad, torch.chunk(ref.bias.grad, ws, 0)[rank], f"{what} bias gradient")


@check
def check_row_parallel_linear(rank: int, ws: int) -> None:
    for bias in (True, False):
        for parallel_in in (True, False):
            what = f"RowParallelLinear(bias={bias}, input_is_parallel={parallel_in})"
            ref = linear(5, 8, 6, bias)
            layer = RowParallelLinear(8, 6, bias=bias, input_is_parallel=parallel_in)
            layer.load_state_dict(shard_state(ref.state_dict(), "row", ws, rank), strict=True)
            x, g = randn(6, 2, 3, 8), randn(7, 2, 3, 6)
            x_ref = leaf(x)
            x_par = leaf(torch.chunk(x, ws, -1)[rank] if parallel_in else x)
            y_ref = ref(x_ref)
            (y_ref * g).sum().backward()
            y = layer(x_par)
            (y * g).sum().backward()
            want_x_grad = torch.chunk(x_ref.grad, ws, -1)[rank] if parallel_in else x_ref.grad
            close(y.detach(), y_ref.detach(), f"{what} output (bias added exactly once)")
            close(x_par.grad, want_x_grad, f"{what} input gradient")
            close(layer.weight.grad, torch.chunk(ref.weight.grad, ws, 1)[rank], f"{what} weight gradient")
            if bias:
                close(layer.bias.grad, ref.bias.grad, f"{what} (replicated) bias gradient")


def _embedding_case(rank: int, ws: int, vocab: int, padded: int | None) -> None:
    what = f"VocabParallelEmbedding(num_embeddings={vocab}, padded_num_embeddings={padded})"
    ref = nn.Embedding(vocab, 5)
    with torch.no_grad():
        ref.weight.copy_(randn(8, vocab, 5))
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(9))
    ids[0, :3] = torch.tensor([0, vocab - 1, vocab - 1])  # both ends, and a repeat
    full = ref.weight.detach()
    if padded is not None:
        full = torch.cat([full, torch.zeros(padded - vocab, 5)])
    layer = VocabParallelEmbedding(vocab, 5, padded_num_embeddings=padded)
    layer.load_state_dict({"weight": torch.chunk(full, ws, 0)[rank].clone()}, strict=True)
    g = randn(10, 3, 7, 5)
    y_ref = ref(ids)
    (y_ref * g).sum().backward()
    y = layer(ids)
    (y * g).sum().backward()
    want_grad = ref.weight.grad
    if padded is not None:
        want_grad = torch.cat([want_grad, torch.zeros(padded - vocab, 5)])
    assert layer.weight.shape == (-(-(padded or vocab) // ws), 5), f"{what}: local shape {layer.weight.shape}"
    close(y.detach(), y_ref.detach(), f"{what} output")
    close(layer.weight.grad, torch.chunk(want_grad, ws, 0)[rank], f"{what} weight gradient")


@check
def check_vocab_parallel_embedding(rank: int, ws: int) -> None:
    _embedding_case(rank, ws, 4 * ws, None)


@check
def check_vocab_parallel_embedding_padded(rank: int, ws: int) -> None:
    _embedding_case(rank, ws, 4 * ws - 1, 4 * ws)  # e.g. 7 rows padded to 8 at tp=2


def _ce_case(rank: int, ws: int, full: torch.Tensor, labels: torch.Tensor, **kw: Any) -> None:
    """`full` may carry padded columns beyond `vocab_size`; the reference sees only the real ones."""
    vocab = kw.get("vocab_size") or full.size(-1)
    what = f"vocab_parallel_cross_entropy({kw})"
    ignore = kw.get("ignore_index", -100)
    ref_in = leaf(full[..., :vocab])
    loss_ref = F.cross_entropy(ref_in.reshape(-1, vocab), labels.reshape(-1), ignore_index=ignore)
    (2.5 * loss_ref).backward()
    shard = leaf(torch.chunk(full, ws, -1)[rank])
    loss = vocab_parallel_cross_entropy(shard, labels, **kw)
    (2.5 * loss).backward()
    want_grad = torch.cat([ref_in.grad, torch.zeros(*full.shape[:-1], full.size(-1) - vocab)], dim=-1)
    assert loss.dim() == 0, f"{what}: loss shape {loss.shape}"
    close(loss.detach(), loss_ref.detach(), f"{what} loss")
    close(shard.grad, torch.chunk(want_grad, ws, -1)[rank], f"{what} logits gradient")


@check
def check_vocab_parallel_cross_entropy(rank: int, ws: int) -> None:
    vocab = 4 * ws
    full = randn(11, 2, 5, vocab, scale=4.0)
    full[0, 0] += 1000.0  # stability: exp would overflow without the max shift
    labels = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(12))
    labels[0, 0], labels[1, 4] = vocab - 1, 0
    ignored = labels.clone()
    ignored[0, 1] = ignored[1, 2] = -100
    _ce_case(rank, ws, full, labels)
    _ce_case(rank, ws, full, ignored)
    custom = labels.clone()
    custom[1, 1] = custom[0, 3] = -1
    _ce_case(rank, ws, full, custom, ignore_index=-1)


@check
def check_vocab_parallel_cross_entropy_padded(rank: int, ws: int) -> None:
    local = 4
    labels = torch.randint(0, 4 * ws - 1, (2, 5), generator=torch.Generator().manual_seed(14))
    labels[0, 0], labels[1, 1] = 4 * ws - 2, -100
    full = randn(13, 2, 5, local * ws, scale=3.0)
    full[..., -1] = 50.0  # a padded column with a dominating value must be ignored
    _ce_case(rank, ws, full, labels, vocab_size=local * ws - 1)
    # the last shard entirely padding (vocab = local * (ws - 1))
    short = labels.clamp(max=local * (ws - 1) - 1)
    full2 = randn(15, 2, 5, local * ws)
    full2[..., local * (ws - 1) :] = 80.0
    _ce_case(rank, ws, full2, short, vocab_size=local * (ws - 1))


@check
def check_padded_lm_head(rank: int, ws: int) -> None:
    """ColumnParallelLinear(padded_out_features) as an lm_head, gathered and into the sharded loss."""
    vocab, padded = 4 * ws - 1, 4 * ws
    ref = linear(16, 6, vocab, True)
    full_sd = {
        "weight": torch.cat([ref.weight.detach(), torch.zeros(1, 6)]),
        "bias": torch.cat([ref.bias.detach(), torch.zeros(1)]),
    }
    x = randn(17, 2, 3, 6)
    labels = torch.randint(0, vocab, (2, 3), generator=torch.Generator().manual_seed(18))
    results = {}
    for gather in (True, False):
        layer = ColumnParallelLinear(6, vocab, padded_out_features=padded, gather_output=gather)
        layer.load_state_dict(shard_state(full_sd, "column", ws, rank), strict=True)
        ref.zero_grad()
        x_ref, x_par = leaf(x), leaf(x)
        if gather:
            y_ref, y = ref(x_ref), layer(x_par)
            g = randn(19, 2, 3, vocab)
            (y_ref * g).sum().backward()
            (y * g).sum().backward()
        else:
            y_ref = F.cross_entropy(ref(x_ref).reshape(-1, vocab), labels.reshape(-1))
            y = vocab_parallel_cross_entropy(layer(x_par), labels, vocab_size=vocab)
            y_ref.backward()
            y.backward()
        want_w = torch.chunk(torch.cat([ref.weight.grad, torch.zeros(1, 6)]), ws, 0)[rank]
        results[gather] = (y.detach(), y_ref.detach(), x_par.grad, x_ref.grad, layer.weight.grad, want_w)
    for gather, (y, y_ref, gx, gx_ref, gw, gw_ref) in results.items():
        what = f"padded lm_head (gather_output={gather})"
        close(y, y_ref, f"{what} output/loss")
        close(gx, gx_ref, f"{what} input gradient")
        close(gw, gw_ref, f"{what} weight gradient")


@check
def check_mlp_block_one_all_reduce_each_way(rank: int, ws: int) -> None:
    up, down = linear(20, 6, 16, True), linear(22, 16, 6, True)
    col, row = ColumnParallelLinear(6, 16), RowParallelLinear(16, 6)
    col.load_state_dict(shard_state(up.state_dict(), "column", ws, rank), strict=True)
    row.load_state_dict(shard_state(down.state_dict(), "row", ws, rank), strict=True)
    x, g = randn(24, 2, 3, 6), randn(25, 2, 3, 6)
    x_ref, x_par = leaf(x), leaf(x)
    y_ref = down(F.gelu(up(x_ref)))
    (y_ref * g).sum().backward()

    calls: list[str] = []
    names = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast"]
    originals = {n: getattr(dist, n) for n in names}

    def counting(name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return wrapper

    try:
        for n in names:
            setattr(dist, n, counting(n))
        y = row(F.gelu(col(x_par)))
        forward_calls, calls[:] = list(calls), []
        (y * g).sum().backward()
        backward_calls = list(calls)
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    assert forward_calls == ["all_reduce"], f"forward collectives: {forward_calls}"
    assert backward_calls == ["all_reduce"], f"backward collectives: {backward_calls}"
    close(y.detach(), y_ref.detach(), "MLP output")
    close(x_par.grad, x_ref.grad, "MLP input gradient")
    close(col.weight.grad, torch.chunk(up.weight.grad, ws, 0)[rank], "MLP up weight gradient")
    close(col.bias.grad, torch.chunk(up.bias.grad, ws, 0)[rank], "MLP up bias gradient")
    close(row.weight.grad, torch.chunk(down.weight.grad, ws, 1)[rank], "MLP down weight gradient")
    close(row.bias.grad, down.bias.grad, "MLP down bias gradient")


@check
def check_non_divisible_sizes_raise_plan_error(rank: int, ws: int) -> None:
    bad = 4 * ws + 1
    cases = [
        (
            lambda: ColumnParallelLinear(6, bad),
            ["ColumnParallelLinear", f"out_features={bad}", "padded_out_features"],
        ),
        (lambda: RowParallelLinear(bad, 6), ["RowParallelLinear", f"in_features={bad}"]),
        (lambda: VocabParallelEmbedding(bad, 3), ["VocabParallelEmbedding", f"num_embeddings={bad}"]),
        (
            lambda: ColumnParallelLinear(6, bad - 2, padded_out_features=bad),
            ["ColumnParallelLinear", f"padded_out_features={bad}"],
        ),
    ]
    for build, words in cases:
        try:
            build()
        except PlanError as e:
            for w in [*words, f"tp={ws}"]:
                assert w in str(e), f"{w!r} missing from: {e}"
        else:
            raise AssertionError(f"no PlanError for {words}")


@check
def check_init_and_meta_load(rank: int, ws: int) -> None:
    torch.manual_seed(1234)  # every rank the same seed, as a trainer would
    col, row, emb = ColumnParallelLinear(6, 8), RowParallelLinear(8, 6), VocabParallelEmbedding(8, 5)
    padded = ColumnParallelLinear(6, 4 * ws - 1, padded_out_features=4 * ws)
    col_w, row_b, emb_w = (
        all_gather_list(col.weight.detach()),
        all_gather_list(row.bias.detach()),
        all_gather_list(emb.weight.detach()),
    )
    # meta -> to_empty -> load: forward equals the reference and the loaded values are kept
    ref = linear(30, 6, 8, True)
    meta = ColumnParallelLinear(6, 8, gather_output=True, device="meta")
    params_meta = all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    sd = shard_state(ref.state_dict(), "column", ws, rank)
    meta.load_state_dict(sd, strict=True)
    x = randn(31, 2, 6)
    y = meta(x)
    assert params_meta, "parameters were not on meta"
    close(y.detach(), ref(x).detach(), "meta-built ColumnParallelLinear after to_empty + load")
    assert torch.equal(meta.weight, sd["weight"]), "loaded weight changed"
    for r in range(1, ws):
        assert not torch.allclose(col_w[0], col_w[r]), f"column shards of rank 0 and {r} are identical"
        assert not torch.allclose(emb_w[0], emb_w[r]), f"embedding shards of rank 0 and {r} are identical"
        assert torch.equal(row_b[0], row_b[r]), f"replicated row bias differs between rank 0 and {r}"
    assert row.weight.abs().max() <= 1 / 8**0.5, "row weight bound must use the global fan-in 8"
    assert col.weight.abs().max() <= 1 / 6**0.5
    if rank == ws - 1:
        assert torch.all(padded.weight[-1] == 0) and padded.bias[-1] == 0, "padded row not zero"
        assert torch.all(padded.weight[:-1] != 0), "real rows left zero"

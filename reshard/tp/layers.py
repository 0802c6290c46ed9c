"""Tensor-parallel layers: constructed with global sizes, holding only this rank's shard.

Shapes and names match plain torch slicing of the full tensors (`tp` = group size, `r` = rank):

    layer                    weight                          bias
    ColumnParallelLinear     torch.chunk(W, tp, dim=0)[r]    torch.chunk(b, tp, dim=0)[r]
    RowParallelLinear        torch.chunk(W, tp, dim=1)[r]    b (full, added once after the all-reduce)
    VocabParallelEmbedding   torch.chunk(E, tp, dim=0)[r]    -

so a rank's slices load with `load_state_dict(..., strict=True)`. A size that tp does not divide is a
`PlanError`; Column and VocabEmbedding accept a padded global size instead (zero rows appended to the
full tensor up to a multiple of tp, e.g. a 32001-row vocabulary as 32002 rows at tp=2).

Initialization happens only in `reset_parameters()`, which `__init__` calls unless the layer is built
on the meta device. `module.to_empty(device=...)` never calls it, so the usual path
(build on meta -> to_empty -> load weights) allocates once and never re-initializes loaded weights.
At tp=1 and with the same seed, a layer initializes exactly like `nn.Linear` / `nn.Embedding`. At tp>1
each shard draws from its own generator, seeded from one draw of the global RNG plus the rank, so the
shards differ (no symmetric neurons) while every rank consumes the global RNG identically (replicated
parameters, such as a RowParallelLinear bias, stay equal across ranks that share a seed).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from reshard.errors import PlanError
from reshard.tp.comm import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    tp_rank,
    tp_world_size,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


def _divisors(n: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def _check_divisible(owner: str, name: str, size: int, tp: int, pad_option: str | None) -> None:
    if size % tp == 0:
        return
    fix = f"pick tp in {{{_divisors(size)}}}"
    if pad_option is not None:
        fix = f"pass {pad_option}={math.ceil(size / tp) * tp} (zero rows padded to a multiple of tp) or {fix}"
    raise PlanError(f"{owner}: {name}={size} is not divisible by tp={tp}; {fix}")


def _padded_total(owner: str, name: str, size: int, padded: int | None, tp: int) -> int:
    """The global row count actually sharded: `padded` if given (validated), else `size`."""
    if size <= 0:
        raise PlanError(f"{owner}: {name}={size} must be positive")
    if padded is None:
        _check_divisible(owner, name, size, tp, f"padded_{name}")
        return size
    if padded < size:
        raise PlanError(f"{owner}: padded_{name}={padded} is smaller than {name}={size}")
    if padded % tp != 0:
        raise PlanError(
            f"{owner}: padded_{name}={padded} is not divisible by tp={tp}; "
            f"use {math.ceil(size / tp) * tp} (the smallest multiple of tp that holds {name}={size})"
        )
    return padded


def _shard_generator(device: torch.device, rank: int, tp: int) -> torch.Generator | None:
    """None at tp=1 (draw from the global RNG, exactly like nn.Linear); else a per-rank generator."""
    if tp == 1:
        return None
    base = int(torch.randint(0, 2**62, (1,)).item())  # one draw of the global CPU RNG on every rank
    gen = torch.Generator(device=device)
    gen.manual_seed(base + rank)
    return gen


def _linear_weight_bound(fan_in: int) -> float:
    """The bound nn.Linear's kaiming_uniform_(a=sqrt(5)) uses, for the *global* fan-in."""
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    return math.sqrt(3.0) * gain / math.sqrt(fan_in) if fan_in > 0 else 0.0


class _TPModule(nn.Module):
    """What every parallel layer shares: its group, tp and rank, and its shard-shaped parameters."""

    def __init__(self, group: ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        self.tp = tp_world_size(group)
        self.rank = tp_rank(group)

    def _make_parameters(
        self, weight_shape: tuple[int, int], bias_size: int | None, device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        """Create `weight` (and `bias` when bias_size is given); initialize them unless on meta."""
        self.weight = nn.Parameter(torch.empty(weight_shape, device=device, dtype=dtype))
        if bias_size is not None:
            self.bias = nn.Parameter(torch.empty(bias_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        if not self.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_TPModule):
    """y = x W^T + b with W split along dim 0 (output features); rank r holds rows r*out/tp...

    Input: the full `x` on every rank (`copy_to_tp_region`: identity forward, all-reduce backward).
    Output: this rank's slice of y along the last dim, or the whole y with `gather_output=True`.
    With `padded_out_features` the weight is `[padded/tp, in]`; the gathered output is trimmed back
    to `out_features`, while a local (non-gathered) output keeps its padded columns (pair it with
    `vocab_parallel_cross_entropy(..., vocab_size=out_features)`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        padded_out_features: int | None = None,
        group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        name = type(self).__name__
        total = _padded_total(name, "out_features", out_features, padded_out_features, self.tp)
        self.in_features = in_features
        self.out_features = out_features
        self.padded_out_features = total
        self.local_out_features = total // self.tp
        self.output_start = self.rank * self.local_out_features
        self.gather_output = gather_output
        self._make_parameters((self.local_out_features, in_features), self.local_out_features if bias else None,
                              device, dtype)

    def reset_parameters(self) -> None:
        """Initialize like nn.Linear over the global shape; padded rows are zero. Not called by to_empty."""
        gen = _shard_generator(self.weight.device, self.rank, self.tp)
        with torch.no_grad():
            bound = _linear_weight_bound(self.in_features)
            self.weight.uniform_(-bound, bound, generator=gen)
            if self.bias is not None:
                bias_bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
                self.bias.uniform_(-bias_bound, bias_bound, generator=gen)
            first_pad = max(0, self.out_features - self.output_start)
            self.weight[first_pad:].zero_()
            if self.bias is not None:
                self.bias[first_pad:].zero_()

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of y (padded columns included), whatever `gather_output` says."""
        return F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_local(x)
        if not self.gather_output:
            return y
        y = gather_from_tp_region(y, self.group)
        if self.padded_out_features != self.out_features:
            y = y[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        pad = (
            f", padded_out_features={self.padded_out_features}"
            if self.padded_out_features != self.out_features
            else ""
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}{pad}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, tp={self.tp}, "
            f"rank={self.rank}, local_out_features={self.local_out_features}"
        )


class RowParallelLinear(_TPModule):
    """y = x W^T + b with W split along dim 1 (input features); rank r holds columns r*in/tp...

    Input: this rank's slice of x along the last dim (`input_is_parallel=True`, e.g. the output of a
    ColumnParallelLinear), or the full x, which is then split (`scatter_to_tp_region`).
    Output: the full y on every rank: the partial products are all-reduced
    (`reduce_from_tp_region`: all-reduce forward, identity backward) and the full, replicated bias
    is added exactly once, after the all-reduce.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        _check_divisible(type(self).__name__, "in_features", in_features, self.tp, None)
        self.in_features = in_features
        self.out_features = out_features
        self.local_in_features = in_features // self.tp
        self.input_start = self.rank * self.local_in_features
        self.input_is_parallel = input_is_parallel
        self._make_parameters((out_features, self.local_in_features), out_features if bias else None, device, dtype)

    def reset_parameters(self) -> None:
        """Initialize like nn.Linear with the global fan-in; the bias from the global RNG. Not called by to_empty."""
        gen = _shard_generator(self.weight.device, self.rank, self.tp)
        with torch.no_grad():
            bound = _linear_weight_bound(self.in_features)
            self.weight.uniform_(-bound, bound, generator=gen)
            if self.bias is not None:
                bias_bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
                self.bias.uniform_(-bias_bound, bias_bound)  # replicated: same draw on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, tp={self.tp}, "
            f"rank={self.rank}, local_in_features={self.local_in_features}"
        )


class VocabParallelEmbedding(_TPModule):
    """nn.Embedding with rows split along the vocabulary; rank r holds rows [r*V/tp, (r+1)*V/tp).

    Ids outside this rank's range look up nothing (zeros); the per-rank results are all-reduced
    (`reduce_from_tp_region`), so every rank returns the full embedding. Ids must lie in
    [0, num_embeddings); no bounds check is made (that would need a host sync).
    With `padded_num_embeddings` the global table was padded with zero rows up to a multiple of tp
    and each rank holds `padded_num_embeddings / tp` rows. `padding_idx` (global) gets no gradient,
    as in nn.Embedding.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padded_num_embeddings: int | None = None,
        padding_idx: int | None = None,
        group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        name = type(self).__name__
        total = _padded_total(name, "num_embeddings", num_embeddings, padded_num_embeddings, self.tp)
        self.padding_idx = padding_idx
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padded_num_embeddings = total
        self.local_num_embeddings = total // self.tp
        self.vocab_start_index = self.rank * self.local_num_embeddings
        self.vocab_end_index = self.vocab_start_index + self.local_num_embeddings
        inside = padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index
        self.local_padding_idx = padding_idx - self.vocab_start_index if inside else None
        self._make_parameters((self.local_num_embeddings, embedding_dim), None, device, dtype)

    def reset_parameters(self) -> None:
        """Initialize like nn.Embedding (N(0, 1)); padded rows are zero. Not called by to_empty."""
        gen = _shard_generator(self.weight.device, self.rank, self.tp)
        with torch.no_grad():
            self.weight.normal_(0.0, 1.0, generator=gen)
            self.weight[max(0, self.num_embeddings - self.vocab_start_index) :].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight, self.local_padding_idx)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group)

    def extra_repr(self) -> str:
        pad = (
            f", padded_num_embeddings={self.padded_num_embeddings}"
            if self.padded_num_embeddings != self.num_embeddings
            else ""
        )
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}{pad}, tp={self.tp}, "
            f"rank={self.rank}, rows=[{self.vocab_start_index}, {self.vocab_end_index})"
        )

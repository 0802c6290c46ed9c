"""Shared machinery for the worker-side TP checks, which run inside spawned gloo ranks.

Every check is `fn(rank, world_size) -> None`, registered with `@check` (in `tp_checks_ops.py` and
`tp_checks_layers.py`), and compares against the single-process math on the full tensors, which
every rank rebuilds from fixed seeds. Checks run their collectives first and assert afterwards, so
one failing check does not leave its peers stuck in a collective. `run_checks` runs every check in
one process group (one spawn per world size keeps the suite fast) and returns each check's
traceback, or None when it passed.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

ATOL = RTOL = 1e-5
CHECK_MODULES = ("tests.support.tp_checks_ops", "tests.support.tp_checks_layers")
CHECKS: dict[str, Callable[[int, int], None]] = {}


def check(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
    name = fn.__name__.removeprefix("check_")
    if name in CHECKS:
        raise ValueError(f"check {name!r} registered twice")
    CHECKS[name] = fn
    return fn


def load_checks() -> dict[str, Callable[[int, int], None]]:
    for module in CHECK_MODULES:
        importlib.import_module(module)
    return CHECKS


def run_checks(rank: int, world_size: int) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, fn in load_checks().items():
        try:
            fn(rank, world_size)
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc()
    return out


def randn(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def close(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    assert actual is not None, f"{what}: got None (no gradient?)"
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def shard_state(sd: dict[str, torch.Tensor], kind: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Plain torch slicing of full tensors, as the layers' docs promise."""
    out = {}
    for name, t in sd.items():
        if kind == "row":
            out[name] = torch.chunk(t, tp, dim=1)[rank] if name == "weight" else t
        else:  # column, vocab
            out[name] = torch.chunk(t, tp, dim=0)[rank]
    return {k: v.clone() for k, v in out.items()}


def linear(seed: int, in_f: int, out_f: int, bias: bool) -> nn.Linear:
    ref = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(randn(seed, out_f, in_f))
        if bias:
            ref.bias.copy_(randn(seed + 1, out_f))
    return ref


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def all_gather_list(t: torch.Tensor) -> list[torch.Tensor]:
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t.contiguous())
    return pieces

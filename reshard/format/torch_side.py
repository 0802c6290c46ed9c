"""The torch side of the format: dtype names, and assembling a selection from a slice handle."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from reshard.format.selection import Selection, selection_shape

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def read_selection(
    fetch: Callable[[tuple[slice, ...]], torch.Tensor], sel: Selection, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Assemble a selection from `fetch(slices)` calls, one per block; padding reads as zeros."""
    out = torch.zeros(selection_shape(sel), dtype=dtype)
    starts = [list(itertools.accumulate((b - a for a, b in dim), initial=0)) for dim in sel]
    for combo in itertools.product(*(range(len(dim)) for dim in sel)):
        src, dst = [], []
        for d, i in enumerate(combo):
            a, b = sel[d][i]
            hi = min(b, shape[d])
            if hi <= a:
                break
            src.append(slice(a, hi))
            dst.append(slice(starts[d][i], starts[d][i] + hi - a))
        else:
            out[tuple(dst)] = fetch(tuple(src))
    return out

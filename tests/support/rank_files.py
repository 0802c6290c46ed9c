"""Rank files as the quantized-checkpoint tests read them: tensors with their self-description, byte-level
equality of tensors, and which ranks of two written directories differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from reshard.format.rank_file import rank_file_name


def rank_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A rank file's tensors, and its self-description per tensor (kind, options, global shape, select)."""
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["tensors"])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (FP8 and packed integers compared as stored)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def differing_ranks(a: Path, b: Path, tp: int) -> list[int]:
    """The ranks whose rank files differ between directories `a` and `b` (both of `tp` ranks)."""
    return [r for r in range(tp) if (a / rank_file_name(r, tp)).read_bytes() != (b / rank_file_name(r, tp)).read_bytes()]


def written_ranks(src: Path, tp: int, out: Path) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """`reshard write SRC --tp TP -o OUT`, then every rank file read (`rank_file`), in rank order."""
    from reshard.cli import main

    assert main(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 0
    return [rank_file(out / rank_file_name(r, tp)) for r in range(tp)]

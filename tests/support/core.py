"""Small helpers for the core tests: hand-built safetensors files, torch references, CLI runs.

Everything here is independent of `reshard.format.checkpoint`/`reshard.plan.types`: files are built byte by byte or
with `safetensors.torch.save_file`, and expected shards are computed with plain torch ops.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from reshard import cli

ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "U8": 1, "F64": 8}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --- hand-built safetensors bytes -----------------------------------------------------------------

def raw_safetensors(header: dict[str, Any] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """`u64 length | header | data`; `header` is a dict (dumped as JSON) or raw bytes; `length` overrides."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    return struct.pack("<Q", n) + blob + data


def entry(dtype: str, shape: Sequence[int], begin: int, end: int | None = None) -> dict[str, Any]:
    """One header entry; `end` defaults to what the shape needs."""
    if end is None:
        n = 1
        for d in shape:
            n *= d
        end = begin + n * ITEMSIZE[dtype]
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def write_file(path: Path, blob: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return path


def valid_file_bytes() -> bytes:
    """A well-formed two-tensor file: a F32 [2, 2] then an I64 [3]."""
    header = {"__metadata__": {"format": "pt"}, "a": entry("F32", [2, 2], 0), "b": entry("I64", [3], 16)}
    return raw_safetensors(header, bytes(range(16)) + bytes(24))


# --- checkpoints ------------------------------------------------------------------------------------

def save_checkpoint(
    root: Path,
    tensors: dict[str, torch.Tensor],
    *,
    config: dict[str, Any] | None = None,
    files: Sequence[Sequence[str]] | None = None,
) -> Path:
    """A checkpoint dir: `model.safetensors`, or with `files` (groups of names) HF-style shards + index."""
    root.mkdir(parents=True, exist_ok=True)
    if files is None:
        save_file(tensors, str(root / "model.safetensors"))
    else:
        weight_map = {}
        for k, names in enumerate(files):
            fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, str(root / fname))
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, tuple(shape), generator=gen, dtype=torch.int64)
    return (torch.randn(tuple(shape), generator=gen) * 3).to(dtype)


# --- torch references ----------------------------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    """A same-shape integer view of `t` (so float8/bf16 compare bit for bit and pad with +0)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (what, tuple(actual.shape), tuple(expected.shape))
    assert torch.equal(bits(actual), bits(expected)), f"{what}: values differ"


def even_chunk(t: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    pieces = torch.chunk(t, tp, dim)
    assert len(pieces) == tp and all(p.shape == pieces[0].shape for p in pieces)
    return pieces[rank]


def padded_chunk(t: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Zero-pad dim `dim` up to a multiple of tp, then chunk (done on the integer view: +0 padding)."""
    n = t.shape[dim]
    size = -(-n // tp) * tp
    shape = list(t.shape)
    shape[dim] = size
    padded = torch.zeros(shape, dtype=bits(t).dtype)
    padded.narrow(dim, 0, n).copy_(bits(t))
    return even_chunk(padded, tp, rank, dim).view(t.dtype)


def head_chunk(t: torch.Tensor, heads: int, tp: int, rank: int) -> torch.Tensor:
    """Dim 0 as `heads` head blocks; with heads < tp each head is repeated tp/heads times, then chunked."""
    h = t.reshape(heads, -1, *t.shape[1:])
    h = torch.repeat_interleave(bits(h), max(1, tp // heads), dim=0).view(t.dtype)
    return even_chunk(h, tp, rank).reshape(-1, *t.shape[1:])


def packed_chunk(
    t: torch.Tensor, blocks: Sequence[int], tp: int, rank: int, heads: Sequence[int] | None = None
) -> torch.Tensor:
    parts = torch.split(bits(t), list(blocks), dim=0)
    out = [
        head_chunk(p, heads[i], tp, rank) if heads else even_chunk(p, tp, rank)
        for i, p in enumerate(parts)
    ]
    return torch.cat(out, dim=0).view(t.dtype)


# --- running the CLI -------------------------------------------------------------------------------------

def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`reshard ARGV` in this process; returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc: int, err: str, *needles: str) -> str:
    """A failed command: non-zero exit, exactly one stderr line `reshard: error: ...`, no traceback."""
    assert rc != 0, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("reshard: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

"""Hand-written resharding scripts, the kind people write before they have a tool; the baselines.

    python -m bench.baselines chunk SRC OUT --tp 4   # load_file every file, torch.chunk, save_file per rank
    python -m bench.baselines slice SRC OUT --tp 4   # per rank: safe_open(...).get_slice per tensor, save_file

Both hard-code the Llama split (column: q/k/v/gate/up/embed/lm_head on dim 0; row: o_proj/down_proj
on dim 1; everything else replicated) and write `rank-XXXXX-of-YYYYY.safetensors`, like reshard. Like
most such scripts they neither fsync nor checksum what they write (reshard does both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DIM0 = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
DIM1 = ("o_proj", "down_proj")


def split_dim(name: str) -> int | None:
    if not name.endswith(".weight"):
        return None
    module = name.rsplit(".", 2)[-2]
    if module in DIM0:
        return 0
    if module in DIM1:
        return 1
    return None


def weight_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        return [src / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [src / "model.safetensors"]


def rank_name(rank: int, tp: int) -> str:
    return f"rank-{rank:05d}-of-{tp:05d}.safetensors"


def chunk_script(src: Path, out: Path, tp: int) -> None:
    """The simplest script: the whole state dict in memory, torch.chunk, one save_file per rank."""
    import torch
    from safetensors.torch import load_file, save_file

    state: dict[str, torch.Tensor] = {}
    for f in weight_files(src):
        state.update(load_file(f))
    for rank in range(tp):
        shard = {}
        for name, t in state.items():
            dim = split_dim(name)
            shard[name] = t if dim is None else torch.chunk(t, tp, dim=dim)[rank].contiguous()
        save_file(shard, out / rank_name(rank, tp), metadata={"format": "pt"})


def slice_script(src: Path, out: Path, tp: int) -> None:
    """Read only what each rank needs: per rank, `get_slice` every tensor, then save_file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = weight_files(src)
    for rank in range(tp):
        shard = {}
        for f in files:
            with safe_open(f, framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    sl = h.get_slice(name)
                    dim = split_dim(name)
                    if dim is None:
                        shard[name] = sl[:]
                        continue
                    n = sl.get_shape()[dim] // tp
                    lo, hi = rank * n, (rank + 1) * n
                    shard[name] = (sl[lo:hi] if dim == 0 else sl[:, lo:hi]).contiguous()
        save_file(shard, out / rank_name(rank, tp), metadata={"format": "pt"})
        del shard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.baselines")
    p.add_argument("method", choices=["chunk", "slice"])
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--tp", type=int, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (chunk_script if args.method == "chunk" else slice_script)(args.src, args.out, args.tp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

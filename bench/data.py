"""The benchmark's inputs: Llama-shaped bf16 checkpoints it generates itself (HF names, several files).

Shapes follow a 1B-class Llama (hidden 2048, intermediate 5632, 32 heads, 8 kv heads, vocab 32000);
the number of layers sets the size: 9 layers ~ 1.07 GB, 42 layers ~ 4.05 GB. A checkpoint is reused
when its `bench-ckpt.json` stamp matches the requested shape.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
STAMP = "bench-ckpt.json"

SIZES: dict[str, dict[str, Any]] = {
    "1gb": {"num_hidden_layers": 9, "num_files": 4},
    "4gb": {"num_hidden_layers": 42, "num_files": 8},
    # tiny: for the smoke test only
    "tiny": {"num_hidden_layers": 2, "num_files": 3, "hidden_size": 256, "intermediate_size": 512,
             "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 512},
}

BASE = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000}


def spec(size: str) -> dict[str, Any]:
    s = dict(SIZES[size])
    num_files = s.pop("num_files")
    return {"config": {**BASE, **s}, "num_files": num_files, "dtype": "bfloat16", "seed": 0}


def checkpoint(size: str, *, root: Path = DATA) -> Path:
    """Path of the `size` checkpoint under `root`, generating it first if missing or stale."""
    import torch

    from reshard.testing.synth import llama_config, make_checkpoint

    path = root / f"llama-{size}"
    want = spec(size)
    stamp = path / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return path
    if path.exists():
        shutil.rmtree(path)
    t0 = time.perf_counter()
    print(f"bench: generating the {size} checkpoint in {path} ...", file=sys.stderr, flush=True)
    make_checkpoint(path, llama_config(**want["config"]), dtype=torch.bfloat16, num_files=want["num_files"], seed=0)
    stamp.write_text(json.dumps(want, indent=2, sort_keys=True))
    print(f"bench: generated {dir_bytes(path) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def warm_page_cache(path: Path) -> None:
    """Read every file once so the timed runs all read from the page cache."""
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(16 << 20):
                    pass


def clear(path: Path) -> None:
    if Path(path).exists():
        shutil.rmtree(path)

"""Session fixtures for the quantized-checkpoint tests: FP8 checkpoints (made once) and their rank shards."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent, HERE.parent / "service"):  # fp8_ckpt, _dist, _live
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from fp8_ckpt import CASES, fp8_checkpoint, write  # noqa: E402


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/NAME for every case of CASES (a directory a `reshard serve --root` can serve)."""
    root = tmp_path_factory.mktemp("fp8") / "root"
    for seed, (name, (config, qc)) in enumerate(CASES.items()):
        fp8_checkpoint(root / name, config, qc, seed=seed)
    return root


@pytest.fixture(scope="session")
def shards(ckpts: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`shards(name, tp) -> Path`: what `reshard write` made of a case (made once per pair)."""
    out = tmp_path_factory.mktemp("fp8_shards")
    made: dict[tuple[str, int], Path] = {}

    def get(name: str, tp: int) -> Path:
        if (name, tp) not in made:
            made[(name, tp)] = write(ckpts / name, tp, out / f"{name}-tp{tp}")
        return made[(name, tp)]

    return get

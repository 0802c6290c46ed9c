"""Session fixtures for the quantized-checkpoint tests: FP8 checkpoints (made once) and their rank shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.fp8_ckpt import CASES, fp8_checkpoint, write


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

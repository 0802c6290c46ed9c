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

from fp8_ckpt import BLOCK_QC, ct_qc, fp8_checkpoint  # noqa: E402

from reshard.cli import main  # noqa: E402
from reshard.synth import llama_config  # noqa: E402

# in=320 (hidden) is 2.5 blocks of 128: the column weights' partial ceil blocks; 8 heads of 128, 2 kv heads
_BASE = {"hidden_size": 320, "num_attention_heads": 8, "head_dim": 128, "num_key_value_heads": 2,
         "intermediate_size": 1024, "num_hidden_layers": 1, "vocab_size": 256}
# name -> (config, quantization_config); every tp in {1, 2, 4, 8} splits these on block edges
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "block": (llama_config(**_BASE), BLOCK_QC),
    "block_phi3": (llama_config(model_type="phi3", **_BASE), BLOCK_QC),  # fused qkv_proj / gate_up_proj
    # per-channel needs no block edges: an intermediate size of 1000 splits at tp=8 (125 rows each)
    "channel": (llama_config(**{**_BASE, "intermediate_size": 1000}), ct_qc("channel")),
    "tensor": (llama_config(**_BASE), ct_qc("tensor", static_input=True)),
}
TPS = (1, 2, 4, 8)


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


def write(src: Path, tp: int, out: Path, *extra: str) -> Path:
    assert main(["write", str(src), "--tp", str(tp), "-o", str(out), "--no-progress", *extra]) == 0
    return out

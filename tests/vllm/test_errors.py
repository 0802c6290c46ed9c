"""What load_format="reshard" refuses, as vLLM reports it: one line naming the tensor or file and the fix.

Each case starts an engine that fails while loading (the line is in the worker's log, captured here):
a parameter no shard tensor fills, and pipeline parallelism. Rank files cut transformers' way, shards of
another tp, FP8 shards and the loader's options are refused before vLLM's model is touched, and are
checked without an engine (tests/core/test_engines.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.support.vllm_engine import engine

pytestmark = pytest.mark.servers


def refused(capfd: pytest.CaptureFixture[str], model_dir: Path, tp: int, **kw: object) -> str:
    """The log of an engine start that must fail; the caller checks it names what went wrong."""
    with pytest.raises(Exception), engine(model_dir, tp, load_format="reshard", **kw):  # noqa: B017 (vLLM's own)
        pass
    got = capfd.readouterr()
    return got.out + got.err  # vLLM logs to stdout


def test_a_parameter_no_shard_fills_is_named(vroot: Path, tmp_path: Path, meta_dir: Callable[[str], Path],
                                             capfd: pytest.CaptureFixture[str]) -> None:
    holey = tmp_path / "llama"
    shutil.copytree(vroot / "llama", holey)
    state = load_file(holey / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(holey / "model.safetensors"), metadata={"format": "pt"})
    from reshard.cli import main

    assert main(["write", str(holey), "--tp", "1", "--engine", "vllm", "-o", str(tmp_path / "w"), "--no-progress"]) == 0
    err = refused(capfd, meta_dir("llama"), 1, model_loader_extra_config={"shards": str(tmp_path / "w")})
    assert ("1 vLLM parameters were not filled whole by the shard: model.layers.1.mlp.down_proj.weight "
            "(0 of 32768 elements)") in err


def test_pipeline_parallelism_is_refused(vserver: object, meta_dir: Callable[[str], Path],
                                         capfd: pytest.CaptureFixture[str]) -> None:
    url = vserver.ckpt_url("llama")  # type: ignore[attr-defined]
    err = refused(capfd, meta_dir("llama"), 1, pipeline_parallel_size=2, model_loader_extra_config={"url": url})
    assert "load_format='reshard' does not support pipeline parallelism yet (pipeline_parallel_size=2)" in err

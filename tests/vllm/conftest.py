"""Fixtures for the vLLM tests (run in the vLLM environment `./run test` sets up: `.venv-vllm`; the main
environment has no vLLM and skips this folder, see tests/conftest.py).

One root of transformers-made checkpoints (tests/support/vllm_ckpts.py), a real `reshard serve` on it and
a second one that asks for a bearer token, the `model=` directories a worker gets from `reshard pull
--meta` (config and tokenizer, no weights), rank files `reshard write --engine vllm` made (both commands
run in this process: a fresh interpreter costs seconds each), and copies of each checkpoint with other
random weights. vLLM's engine core and its model checks run in this process (tests/support/vllm_engine.py).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reshard.cli import main
from tests.support.live import LiveServer, live_server
from tests.support.vllm_ckpts import MODELS, make_model
from tests.support.vllm_engine import engine_env, inspect_in_process

# before vLLM is imported: its temporary, cache and RPC paths, thread binding, the engine core in process
_ENGINE_TMP = tempfile.TemporaryDirectory(prefix="reshard-vllm-")  # removed when the session's process exits
os.environ.update(engine_env(Path(_ENGINE_TMP.name)))
inspect_in_process()
TOKEN = "vllm-tests-token"


@pytest.fixture(scope="session")
def vroot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/NAME for every model of MODELS (served), and ROOT/../others/NAME with other weights."""
    base = tmp_path_factory.mktemp("vllm")
    for name in MODELS:
        make_model(base / "root" / name, name, seed=0)
        make_model(base / "others" / name, name, seed=1)
    return base / "root"


@pytest.fixture(scope="session")
def vserver(vroot: Path) -> Iterator[LiveServer]:
    with live_server(vroot) as srv:
        yield srv


@pytest.fixture(scope="session")
def vserver_token(vroot: Path) -> Iterator[LiveServer]:
    """`reshard serve --token TOKEN` on the same root."""
    with live_server(vroot, token=TOKEN) as srv:
        yield srv


@pytest.fixture(scope="session")
def meta_dir(vserver: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`meta_dir(name)`: config, tokenizer and generation config pulled with `reshard pull --meta`, no weights."""
    base = tmp_path_factory.mktemp("meta")

    def get(name: str) -> Path:
        out = base / name
        if not out.exists():
            assert main(["pull", vserver.ckpt_url(name), "--meta", "-o", str(out)]) == 0
        return out

    return get


@pytest.fixture(scope="session")
def vwritten(vroot: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`vwritten(name, tp, engine="vllm")`: the rank files `reshard write` made (engine None: transformers' cut)."""
    base = tmp_path_factory.mktemp("written")

    def get(name: str, tp: int, engine: str | None = "vllm") -> Path:
        out = base / f"{name}-tp{tp}-{engine}"
        if not out.exists():
            extra = ["--engine", engine] if engine else []
            assert main(["write", str(vroot / name), "--tp", str(tp), "-o", str(out), "--no-progress", *extra]) == 0
        return out

    return get

"""vLLM's own model classes built and filled in the test process, without an engine (nothing spawned).

What a vLLM worker does to load a model, step by step, at tp=1: the config vLLM's engine makes
(`EngineArgs(...).create_engine_config()`), vLLM's distributed state for one rank (gloo), the loader of
the config's `load_format` (`get_model_loader`: vLLM's default loader, or the plugin's through the entry
point), the model built by that loader (`create_model`, parameters allocated) and filled by its
`load_weights`. The parameters are then as the checkpoint's layout has them, before vLLM processes them
for its kernels, so two loads compare parameter by parameter. A build takes well under a second.

At `tensor_parallel_size=N` (a keyword of `built`/`loaded`) the same runs in each of N processes that
`tests.support.dist.run_distributed` joined in a gloo group: vLLM's state for this process's rank is made
on that group, and each rank's model holds that rank's parameters (`rank_params`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from torch import nn

from tests.support.vllm_engine import MODEL_ARGS


@dataclass
class Built:
    """vLLM's config, loader and model (built, not yet filled) for one model directory."""

    config: Any
    loader: Any
    model: nn.Module

    def load(self) -> None:
        """The loader's `load_weights`, as vLLM's worker calls it."""
        self.loader.load_weights(self.model, self.config.model_config)


@contextlib.contextmanager
def built(model_dir: Path, **load: Any) -> Iterator[Built]:
    """vLLM's model for `model_dir`, built by the loader that `load` (EngineArgs: load_format,
    model_loader_extra_config) chooses, inside vLLM's distributed state for one rank, torn down after."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, **{**MODEL_ARGS, **load}).create_engine_config()
    tp = config.parallel_config.tensor_parallel_size
    store = Path(tempfile.mkdtemp(prefix="vllm-dist-")) / "store"
    with set_current_vllm_config(config):
        rank = torch.distributed.get_rank() if tp > 1 else 0  # (run_distributed's group: vLLM builds on it)
        init_distributed_environment(tp, rank, f"file://{store}", rank, "gloo")
        try:
            ensure_model_parallel_initialized(tp, 1)  # (under a MoE config: the expert-parallel group too)
            loader = get_model_loader(config.load_config)
            with set_default_torch_dtype(torch.float32), torch.device("cpu"):
                model = loader.create_model(config, config.model_config)
            yield Built(config, loader, model)
        finally:
            if tp == 1:
                cleanup_dist_env_and_memory()
            else:  # vLLM's groups, not the caller's
                _leave_vllm_groups()


def _leave_vllm_groups() -> None:
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:  # noqa: SLF001
        parallel_state._WORLD.destroy()  # noqa: SLF001
    parallel_state._WORLD = None  # noqa: SLF001


def loaded(model_dir: Path, **load: Any) -> dict[str, torch.Tensor]:
    """Every parameter of vLLM's model for `model_dir` filled by the loader `load` chooses, by name."""
    with built(model_dir, **load) as b:
        b.load()
        return {name: p.detach().clone() for name, p in b.model.named_parameters()}


def loaded_by_reshard(model_dir: Path, engine: dict[str, Any] | None = None, **source: str) -> dict[str, torch.Tensor]:
    """`loaded` with load_format="reshard" and `source` as its model_loader_extra_config (`engine`: more
    EngineArgs, as `loaded` takes them)."""
    return loaded(model_dir, load_format="reshard", model_loader_extra_config=source, **(engine or {}))


def rank_params(rank: int, world: int, cases: dict[str, tuple[str, str, str]],
                engine: dict[str, Any]) -> dict[str, tuple[list[str], dict[str, list[int]]]]:
    """In a `run_distributed` rank, per case (full checkpoint, `model=` directory without weights, rank files or
    the service's checkpoint URL):
    the parameters of vLLM's model at tp=`world` whose load by reshard differs from vLLM's default load of the
    full checkpoint (empty: every parameter equal), and every parameter's shape on this rank."""
    from tests.support.vllm_engine import inspect_in_process

    inspect_in_process()
    engine = {**engine, "tensor_parallel_size": world, "distributed_executor_backend": "mp"}
    out = {}
    for case, (full, meta, shards) in cases.items():
        want = loaded(Path(full), **engine)
        source = {"url": shards} if shards.startswith("http") else {"shards": shards}
        got = loaded_by_reshard(Path(meta), engine, **source)
        assert list(got) == list(want), (case, rank, sorted(set(got) ^ set(want)))
        out[case] = ([n for n in want if not torch.equal(got[n], want[n])], {n: list(t.shape) for n, t in got.items()})
    return out


def store_rules(checkpoint_url: str, label: str, *, first: dict[str, Any] | None = None) -> None:
    """The manifest that applies to the checkpoint, stored on the service under `label` (`first`: a rule put
    before the others)."""
    manifest = httpx.get(f"{checkpoint_url}/rules", timeout=30).json()["manifest"]
    if first is not None:
        manifest["rules"].insert(0, first)
    stored = httpx.put(f"{checkpoint_url}/rules", params={"label": label}, json=manifest, timeout=30)
    assert stored.status_code == 200, stored.text

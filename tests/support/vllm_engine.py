"""A vLLM engine on the CPU backend for the tests: start one, generate greedily with top-5 logprobs, reload
its weights with vLLM's default loader in place, shut it down.

The reference of every comparison is vLLM's own default load of the same checkpoint, in the same engine:
`reload_default` runs vLLM's `reload_weights` in each worker (`collective_rpc`) with load_format
"safetensors", which reads every tensor in full and narrows it by tp_rank, as a default start does.
One engine start thus gives both loads.

A start is mostly processes and imports, so the tests keep them few (`engine_env`, `inspect_in_process`):
vLLM's engine core runs in the test process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as vLLM's own start-up
benchmark runs it), so at tp=1 the one worker does too (vLLM's "uni" executor, its default at tp=1) and at
tp=2 only the two workers are spawned (vLLM's CPU backend spawns them, each importing vLLM); vLLM's check
of a model class runs here instead of in a fresh interpreter per architecture. The environment also
points vLLM's temporary, cache and RPC paths at a test directory, binds one OpenMP thread per rank, lets
`collective_rpc` pickle the reload function and stops workers after 1 s.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# what every engine and every model the tests build has in common: float32, eager, a short context
MODEL_ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "seed": 0}
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [999, 3, 998, 17, 42]]
MAX_TOKENS = 8
LOGPROBS = 5


def engine_env(root: Path) -> dict[str, str]:
    """The environment the engines need (see the module docstring)."""
    for sub in ("tmp", "cache", "rpc"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    return {"TMPDIR": str(root / "tmp"), "VLLM_CACHE_ROOT": str(root / "cache"), "VLLM_RPC_BASE_PATH": str(root / "rpc"),
            "VLLM_CPU_OMP_THREADS_BIND": "0|1" if cores >= 2 else "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_LOGGING_LEVEL": "WARNING",
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def inspect_in_process() -> None:
    """vLLM's check of a model class (`_ModelInfo`) in this process: vLLM runs it in a fresh interpreter,
    15-17 s per architecture here, only to keep CUDA uninitialized in the caller; the CPU backend has none."""
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()  # noqa: SLF001


@contextlib.contextmanager
def engine(model_dir: Path, tp: int, **load: Any) -> Iterator[Any]:
    """`vllm.LLM` for `model_dir` at `tp` (MODEL_ARGS, a 32 MiB KV cache), shut down afterwards."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), tensor_parallel_size=tp, **MODEL_ARGS, kv_cache_memory_bytes=32 << 20,
              max_num_seqs=4, distributed_executor_backend="uni" if tp == 1 else "mp", **load)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=1)
        del llm
        gc.collect()


def generate(llm: Any) -> list[dict[str, Any]]:
    """Greedy tokens of every prompt and, per step, the top-5 token ids and their logprobs."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "top": [{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]} for o in outs]


def _reload_default(worker: Any, path: str) -> str:
    """In a worker: vLLM's `reload_weights` from the full checkpoint at `path` with its default loader."""
    load = worker.vllm_config.load_config
    saved = load.load_format, load.model_loader_extra_config
    load.load_format, load.model_loader_extra_config = "safetensors", {}
    try:
        worker.model_runner.reload_weights(weights_path=path)
    finally:
        load.load_format, load.model_loader_extra_config = saved
    return path


def reload_default(llm: Any, ckpt: Path) -> None:
    llm.collective_rpc(_reload_default, args=(str(ckpt),))


def _report(worker: Any) -> tuple[int, int, int]:
    report = worker.model_runner.get_model().reshard_fill_report
    return report.rank, report.tp, report.bytes


def fill_reports(llm: Any) -> dict[int, tuple[int, int]]:
    """rank -> (tp, bytes of the rank stream it read), from each worker's reshard fill report."""
    return {rank: (tp, nbytes) for rank, tp, nbytes in llm.collective_rpc(_report)}


def differences(got: list[dict[str, Any]], want: list[dict[str, Any]], *, tol: float = 1e-4) -> list[str]:
    """Where two `generate` results differ: tokens, the top-5 ids of a step, or a logprob by more than `tol`."""
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g["tokens"] != w["tokens"]:
            out.append(f"prompt {i}: tokens {g['tokens']} != {w['tokens']}")
        for s, (gs, ws) in enumerate(zip(g["top"], w["top"])):
            if set(gs) != set(ws):
                out.append(f"prompt {i} step {s}: top ids {sorted(gs)} != {sorted(ws)}")
            elif any(not math.isclose(gs[k], ws[k], abs_tol=tol) for k in gs):
                out.append(f"prompt {i} step {s}: logprobs {gs} != {ws}")
    return out

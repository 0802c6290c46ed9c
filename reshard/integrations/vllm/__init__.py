"""vLLM model-loader plugin: `load_format="reshard"`, each TP rank loads only its own shard.

Installing reshard beside vLLM registers `register` under vLLM's `vllm.general_plugins` entry point
(pyproject), which vLLM calls in every process it starts (front end, engine core, workers)::

    LLM(model=DIR, load_format="reshard", tensor_parallel_size=2,
        model_loader_extra_config={"url": "http://HOST:8000/v1/checkpoints/NAME"})   # or {"shards": DIR}

DIR holds config.json and the tokenizer only (`reshard pull URL --meta -o DIR`, or `pull_model_dir`).
See docs/vllm.md. Nothing here imports vLLM until `register` runs.
"""

from __future__ import annotations

import os
from pathlib import Path

from reshard.io.client.shard_client import ShardClient

LOAD_FORMAT = "reshard"
_registered = False


def register() -> None:
    """vLLM's general-plugin hook: make `load_format="reshard"` known in this process (once)."""
    global _registered
    if _registered:
        return
    from reshard.integrations.vllm.loader import register_loader

    register_loader()
    _registered = True


def pull_model_dir(url: str, dest: str | os.PathLike[str], *, token: str | None = None) -> str:
    """The checkpoint's config.json, tokenizer and generation config copied into `dest` from the service
    (what `reshard pull URL --meta -o DEST` does): the `model=` directory for vLLM. Returns `dest`."""
    with ShardClient(url, token=token) as client:
        client.pull_meta(dest)
    return str(Path(dest))

"""One vLLM start for bench/compare_vllm.py (run in the vLLM environment, .venv-vllm):

    python -m bench.vllm_worker default|url|shards MODEL_DIR SOURCE OUT.json

`default`: `LLM(model=MODEL_DIR)` reads the full checkpoint there; `url` / `shards`: `load_format="reshard"`
from the service's checkpoint URL or a directory of rank files, MODEL_DIR holding config.json only.
Writes `ready_s` (from the launch time the caller passes in RESHARD_T0 until `LLM(...)` returns), each
rank's bytes (the plugin's report; for `default`, the bytes vLLM's own weights iterator hands the rank,
counted by running that iterator in the worker after start-up) and 4 greedy tokens of a fixed prompt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TP = 2


def _rank_bytes(worker: Any, mode: str, ckpt: str) -> dict[str, Any]:
    """In a worker: what it read (the plugin's report), or what vLLM's default iterator yields it."""
    from vllm.distributed import get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    model = worker.model_runner.get_model()
    if mode != "default":
        report = model.reshard_fill_report
        return {"rank": rank, "bytes": report.bytes, "load_s": report.seconds}
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    config = worker.vllm_config.model_config
    total = sum(t.numel() * t.element_size() for _name, t in loader.get_all_weights(config, model))
    return {"rank": rank, "bytes": total, "load_s": None, "checkpoint": ckpt}


def main() -> None:
    mode, model_dir, source, out = sys.argv[1:5]
    t0 = float(os.environ["RESHARD_T0"])
    from vllm import LLM, SamplingParams

    load: dict[str, Any] = {}
    if mode != "default":
        load = {"load_format": "reshard", "model_loader_extra_config": {mode: source}}
    llm = LLM(model=model_dir, tensor_parallel_size=TP, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              seed=0, gpu_memory_utilization=0.1, max_num_seqs=2, skip_tokenizer_init=True,
              distributed_executor_backend="mp", **load)
    ready = time.time() - t0
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}],
                        SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)
    ranks = llm.collective_rpc(_rank_bytes, args=(mode, source))
    Path(out).write_text(json.dumps({"ready_s": ready, "tokens": list(outs[0].outputs[0].token_ids),
                                     "ranks": sorted(ranks, key=lambda r: r["rank"])}))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()

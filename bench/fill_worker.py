"""One TP worker's start-up, for `bench/compare_fill.py`; run under `torchrun --nproc-per-node 2`:

    python -m bench.fill_worker from_pretrained CKPT_DIR OUT_DIR   # transformers on the full checkpoint
    python -m bench.fill_worker fill URL OUT_DIR                   # empty_tp_model + fill_model from the service

`RESHARD_T0` (the launch time) makes `ready_s` count from launch: interpreter and torch start-up,
process group, building and loading, until the model is ready. Each rank writes OUT_DIR/rank-R.json:
ready_s, load_s (from the first model call), the bytes it pulled (fill), its /proc/self/io read
counters and RssAnon/RssFile when ready, and a checksum of its logits for 8 fixed tokens (equal in both modes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return out


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(mode: str, source: str, out_dir: str) -> None:
    t0 = float(os.environ.get("RESHARD_T0", time.time()))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    io0, t_load = _io(), time.perf_counter()
    pulled = None
    if mode == "from_pretrained":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source, tp_plan="auto")
    elif mode == "fill":
        import reshard

        model = reshard.empty_tp_model(source)
        pulled = reshard.fill_model(model, source).bytes
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    load_s, ready_s, io1 = time.perf_counter() - t_load, time.time() - t0, _io()
    memory = {"rss_anon_mib": _status_mib("RssAnon"), "rss_file_mib": _status_mib("RssFile")}  # at ready
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8).reshape(1, 8)).logits
    result = {"rank": rank, "ready_s": ready_s, "load_s": load_s, "bytes_pulled": pulled,
              "read_bytes": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"],
              "logits_sum": float(logits.double().sum()), "dtype": str(next(model.parameters()).dtype), **memory}
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])

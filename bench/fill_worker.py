"""One TP worker's start-up, for `bench/compare_fill.py` and `bench/compare_link.py`; run under torchrun or
`reshard launch`, one process per rank:

    python -m bench.fill_worker from_pretrained CKPT_DIR OUT_DIR   # transformers on the full checkpoint
    python -m bench.fill_worker fill SOURCE OUT_DIR                # empty_tp_model + fill_model (URL or rank files)
    python -m bench.fill_worker fill-model SOURCE OUT_DIR          # the same, fill_model(..., follow="model")

`RESHARD_T0` (the launch time) makes `ready_s` count from launch: interpreter, imports (or the fork),
process group, building and loading, until the model is ready. Each rank writes OUT_DIR/rank-R.json:
ready_s, start_s (launch until this file's first line ran), load_s; the post-import baseline (VmRSS
once torch, transformers and the checkpoint's model class are imported, before the process group and
the model) and VmHWM, RssAnon, RssFile and RssShmem when ready; the bytes it pulled, mapped and how
they were verified (fill); its /proc/self/io read counters; a checksum of its logits for 8 fixed
tokens (equal in every mode).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

T_START = time.time()


def _io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return out


def _status_mib(*fields: str) -> dict[str, float]:
    out = dict.fromkeys(fields, float("nan"))
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in out:
            out[key] = int(line.split()[1]) / 1024
    return out


def _import_model_class(mode: str, source: str) -> None:
    """What every mode imports before loading: transformers and the checkpoint's model class (as the
    launcher's preload does, and as from_pretrained would). A fill switches reshard's import cache on
    first, as `empty_tp_model` does before it imports transformers (and a worker of reshard's does,
    docs/launch.md): transformers is then imported through `reshard.importcache`."""
    if mode != "from_pretrained":
        import reshard

        reshard.enable_import_cache()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if mode == "from_pretrained":
        config = transformers.AutoConfig.from_pretrained(source)
    else:
        from reshard.fill.empty_model import source_config

        config = transformers.AutoConfig.for_model(**source_config(source))
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # noqa: B018  imports the modeling module


def main(mode: str, source: str, out_dir: str) -> None:
    t0 = float(os.environ.get("RESHARD_T0", T_START))
    start_s = T_START - t0
    import torch
    import torch.distributed as dist

    _import_model_class(mode, source)
    base = _status_mib("VmRSS")["VmRSS"]  # the post-import baseline
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    io0, t_load = _io(), time.perf_counter()
    fill: dict[str, object] = {}
    if mode == "from_pretrained":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source, tp_plan="auto")
    elif mode in ("fill", "fill-model"):
        import reshard

        model = reshard.empty_tp_model(source)
        report = reshard.fill_model(model, source, follow="model" if mode == "fill-model" else "shard")
        fill = {"bytes_pulled": report.bytes, "mapped": report.mapped, "verified": report.verified}
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    load_s, ready_s, io1 = time.perf_counter() - t_load, time.time() - t0, _io()
    memory = _status_mib("VmHWM", "RssAnon", "RssFile", "RssShmem")  # at ready
    params = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8).reshape(1, 8)).logits
    result = {"rank": rank, "ready_s": ready_s, "start_s": start_s, "load_s": load_s, "base_rss_mib": base,
              "hwm_mib": memory["VmHWM"], "rss_anon_mib": memory["RssAnon"], "rss_file_mib": memory["RssFile"],
              "rss_shmem_mib": memory["RssShmem"], "param_mib": params / 2**20, **fill,
              "read_bytes": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"],
              "logits_sum": float(logits.double().sum()), "dtype": str(next(model.parameters()).dtype)}
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])

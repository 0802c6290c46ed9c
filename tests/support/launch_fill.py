"""What a rank runs under `reshard launch --prefetch URL` in tests/fill: `python -m tests.support.launch_fill URL
SHARD_DIR OUT_DIR`. Fills transformers' TP model from URL (the prefetched shard, if the launcher fetched
it) and another from the rank files of SHARD_DIR; writes OUT_DIR/rank-R.json: both reports and whether
the logits are equal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import reshard
from tests.support.fill_checks import ids_for

if __name__ == "__main__":
    url, shards, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    result = {}
    logits = []
    for source in (url, shards):
        model = reshard.empty_tp_model(source)
        report = reshard.fill_model(model, source)
        result[source] = {"name": report.source, "mapped": report.mapped, "verified": report.verified}
        with torch.no_grad():
            logits.append(model(input_ids=ids_for(model.config.vocab_size)).logits)
    result["equal"] = torch.equal(*logits)
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()

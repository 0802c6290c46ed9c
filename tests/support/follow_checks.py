"""The gloo ranks of `fill_model` (tests/fill/test_follow_model.py): for each checkpoint, transformers' own
`from_pretrained(tp_plan="auto")` against `empty_tp_model` + `fill_model` (each `follow` asked for: "model",
"auto", the default), every local tensor compared bit for bit, the logits, and the bytes the service sent
each rank (in turn)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import reshard
from tests.support.fill_checks import ids_for, local_state, same_bits, served_bytes

__all__ = ["follow_model_job"]


def follow_model_job(rank: int, world: int, cases: dict[str, dict[str, Any]], server: str,
                     follows: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """{checkpoint: {follow: what was found}}; "auto" is `fill_model`'s default, called with no `follow`."""
    from transformers import AutoModelForCausalLM

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))  # as torchrun sets them
    out: dict[str, Any] = {}
    for name, case in cases.items():
        ref = AutoModelForCausalLM.from_pretrained(case["path"], tp_plan="auto", dtype=torch.float32).eval()
        want, ids = local_state(ref), ids_for(case["vocab"])
        with torch.no_grad():
            logits = ref(input_ids=ids).logits
        out[name] = {}
        for follow in follows:
            model = reshard.empty_tp_model(case["url"], dtype=torch.float32)
            kw = {} if follow == "auto" else {"follow": follow}
            report, served = None, 0.0
            for turn in range(world):  # in turn: each rank's bytes off the service's counter
                dist.barrier()
                if turn == rank:
                    before = served_bytes(server)
                    report = reshard.fill_model(model, case["url"], **kw)
                    served = served_bytes(server) - before
            dist.barrier()
            got = local_state(model)
            with torch.no_grad():
                diff = (logits - model(input_ids=ids).logits).abs().max().item()
            assert report is not None
            out[name][follow] = {
                "differ": sorted(n for n in want if not same_bits(want[n], got[n])), "max_diff": diff,
                "held": sum(t.numel() for t in got.values()), "bytes": report.bytes, "served": served,
                "fused": report.fused, "verified": report.verified, "followed": report.follow}
    return out

"""Which transformers architectures the bundled TP trainer supports: `python -m bench.trainer_support`.

For every architecture in `tests/support/trainer_archs.py`, a tiny random
checkpoint is sharded at tp=2 and built by 2 real gloo ranks; the logits are compared with transformers'
own single-process model (`from_pretrained` on the full checkpoint). Writes
`bench/results/trainer_support.json`: per model_type, supported or not, the max abs logit difference,
or the one-line error the trainer gives.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "trainer_support.json"
TP = 2


def job(rank: int, world_size: int, cases: dict[str, str], ids: torch.Tensor) -> dict[str, Any]:
    import transformers

    from reshard.errors import ReshardError
    from reshard.trainer import build_model

    transformers.logging.set_verbosity_error()
    out: dict[str, Any] = {}
    for name, shards in cases.items():
        try:
            model = build_model(shards).eval()
            with torch.no_grad():
                out[name] = model(input_ids=ids).logits
        except ReshardError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.trainer_support", description=__doc__.split("\n\n")[0]).parse_args(argv)
    import transformers

    from reshard.cli import main as reshard_cli
    from tests.support import trainer_archs as archs
    from tests.support.dist import run_distributed

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        cases, refs = {}, {}
        for name in archs.ARCHS:
            full = archs.make_checkpoint(name, Path(tmp) / name / "full")
            assert reshard_cli(["write", str(full), "--tp", str(TP), "-o", str(full.parent / "tp"), "--no-progress"]) == 0
            cases[name] = str(full.parent / "tp")
            with torch.no_grad():
                model = transformers.AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32).eval()
                refs[name] = model(input_ids=archs.IDS).logits
        results = run_distributed(job, TP, cases, archs.IDS, timeout=600)
    table: dict[str, Any] = {}
    for name, (model_type, _) in archs.ARCHS.items():
        got = results[0][name]
        if isinstance(got, str):
            entry = {"supported": False, "error": got}
        else:
            diff = float((got - refs[name]).abs().max())
            entry = {"supported": diff <= 1e-5, "tp": TP, "max_abs_logit_diff": diff,
                     "moe": name in archs.MOE_ARCHS}
        table.setdefault(model_type, {})[name] = entry
    summary = {"transformers": transformers.__version__, "check": f"tp={TP} logits vs from_pretrained, fp32, "
               "max abs diff <= 1e-5", "model_types": {mt: {"supported": all(e["supported"] for e in v.values()),
                                                        "cases": v} for mt, v in sorted(table.items())}}
    OUT.write_text(json.dumps(summary, indent=2) + "\n")
    for mt, v in summary["model_types"].items():
        print(f"{mt:14} {'yes' if v['supported'] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

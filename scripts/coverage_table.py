"""The architecture coverage table of docs/transformers.md, from the plan tests' results.

    .venv/bin/python scripts/coverage_table.py --run     # run tests/rules/tp_plans, record results, update the docs
    .venv/bin/python scripts/coverage_table.py           # update the docs from the recorded results
    .venv/bin/python scripts/coverage_table.py --check   # exit 1 if the docs' tables are not the recorded ones

`render` makes the table; `scripts/gen_docs.py` puts it (with every other generated table) in place.

Results: `tests/rules/tp_plans/results/coverage.json`, written by the plan tests when $RESHARD_COVERAGE_OUT
names it. The trainer column reads `bench/results/trainer_support.json` (written by
`python -m bench.trainer_support`: tp=2 logits of reshard's trainer vs `from_pretrained`), else shows "-".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests/rules/tp_plans/results/coverage.json"
TRAINER = ROOT / "bench/results/trainer_support.json"


def _mark(value: object) -> str:
    return {True: "yes", False: "no", None: "n/a"}.get(value, str(value))  # type: ignore[call-overload]


def render(results: dict, trainer: dict | None) -> str:
    archs = results["architectures"]
    trained = {name: ("yes" if r.get("supported") else "no") for name, r in (trainer or {}).get("model_types", {}).items()}
    lines = [
        f"Tested with transformers {results['transformers_version']}: each row is a tiny random model saved by "
        f"`save_pretrained` (several files), resharded by `reshard write --tp 2` and `--tp 4` with no rules file. "
        f"trainer: reshard's trainer at tp=2 gives transformers' logits (`bench/results/trainer_support.json`; "
        f"- = not tested).",
        "",
        "| model_type | MoE | planned from config.json | equal to transformers' TP, tp=2 | kv heads replicated, tp=4 | trainer |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in archs.items():
        planned = "yes" if r.get("planned_from") else "no"
        equal = _mark(r.get("equal_tp2", False))
        fused = [role for role, key in (("q\\|k\\|v", ".qkv_proj."), ("gate\\|up", ".gate_up_proj."),
                                        ("experts' gate\\|up", ".experts.gate_up_proj"))
                 if any(key in n if key.endswith(".") else n.endswith(key) for n in r.get("per_block", ()))]
        if fused:
            equal += f", except fused {', '.join(fused)}: split per block (equal to torch's per-block split)"
        if r.get("fused_experts"):
            equal += " (fused experts rebuilt from the per-expert shards)"
        if r.get("fused_on_disk"):
            equal += " (experts fused on disk, split per block)"
        kv = _mark(r.get("kv_replicated_tp4"))
        lines.append(f"| {name} | {_mark(r.get('moe', False))} | {planned} | {equal} | {kv} | {trained.get(name, '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run tests/rules/tp_plans first to record fresh results")
    parser.add_argument("--check", action="store_true", help="only check that the docs hold the recorded tables")
    args = parser.parse_args(argv)
    if args.run:
        env = {**os.environ, "RESHARD_COVERAGE_OUT": str(RESULTS)}
        rc = subprocess.call([sys.executable, "-m", "pytest", "tests/rules/tp_plans", "-q"], cwd=ROOT, env=env)
        if rc != 0:
            print("tests/rules/tp_plans failed; the docs not updated", file=sys.stderr)
            return rc
    import gen_docs  # beside this script; it imports `render` from here

    return gen_docs.main(["--check"] if args.check else [])


if __name__ == "__main__":
    sys.exit(main())

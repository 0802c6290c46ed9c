"""The README's architecture coverage table, from the plan tests' results.

    .venv/bin/python scripts/coverage_table.py --run     # run tests/plans, record results, update README
    .venv/bin/python scripts/coverage_table.py           # update README from the recorded results
    .venv/bin/python scripts/coverage_table.py --check   # exit 1 if README's table is not the recorded one

Results: `tests/plans/results/coverage.json`, written by the plan tests when $RESHARD_COVERAGE_OUT
names it. The trainer column reads `bench/results/trainer_support.json` (written by
`python -m bench.trainer_support`: tp=2 logits of reshard's trainer vs `from_pretrained`), else shows "-".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _generated import write_or_check

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests/plans/results/coverage.json"
TRAINER = ROOT / "bench/results/trainer_support.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- plan-coverage:begin -->", "<!-- plan-coverage:end -->"


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


def _readme_with(table: str) -> str:
    text = README.read_text(encoding="utf-8")
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:a] + "\n" + table + "\n" + text[b:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run tests/plans first to record fresh results")
    parser.add_argument("--check", action="store_true", help="only check that README holds the recorded table")
    args = parser.parse_args(argv)
    if args.run:
        env = {**os.environ, "RESHARD_COVERAGE_OUT": str(RESULTS)}
        rc = subprocess.call([sys.executable, "-m", "pytest", "tests/plans", "-q"], cwd=ROOT, env=env)
        if rc != 0:
            print("tests/plans failed; README not updated", file=sys.stderr)
            return rc
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    trainer = json.loads(TRAINER.read_text(encoding="utf-8")) if TRAINER.is_file() else None
    return write_or_check(README, _readme_with(render(results, trainer)), check=args.check,
                          done=f"README: coverage table of {len(results['architectures'])} architectures")


if __name__ == "__main__":
    sys.exit(main())

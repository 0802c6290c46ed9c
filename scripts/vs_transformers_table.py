"""docs/trainer-vs-transformers.md's tables, from what `scripts/vs_transformers.py` found (no torch imported here:
`scripts/gen_docs.py` renders it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "tests" / "trainer" / "results" / "vs_transformers.json"
NAMES = {"tp2": "tp=2", "fsdp2": "fsdp=2", "dp2": "dp=2", "tp1": "tp=1"}
SLOTS = ("param", "exp_avg", "exp_avg_sq", "step")


def _in_order(cases: dict[str, Any]) -> list[tuple[str, Any]]:
    """The resumed layouts in `NAMES`' order (the JSON keeps its keys sorted)."""
    return [(k, cases[k]) for k in NAMES if k in cases]


def _diff(x: float | None) -> str:
    if x is None:
        return "-"
    return "0 (bit for bit)" if x == 0 else f"{x:.1e}"


def _state(reloaded: dict[str, Any]) -> str:
    if not reloaded:
        return "-"
    bad = []
    for slot in SLOTS:
        s = reloaded[slot]
        if s["missing"] or s["shape"] or s["max_abs_diff"]:
            bad.append(f"{slot}: {s['differ']} tensors differ (max {s['max_abs_diff']:.1e}), "
                       f"{len(s['missing'])} missing, {len(s['shape'])} of another shape")
    return "; ".join(bad) if bad else "equal (parameters, both moments, step)"


def _outcome(case: dict[str, Any]) -> str:
    v = case["transformers"]
    if v in ("error", "hang"):
        return f"**{v}**: `{case['error']}`"
    return v if v == "agrees" else f"**{v}**"


def _reshard(case: dict[str, Any]) -> str:
    return _diff(case["reshard_vs_uninterrupted"]) if case["reshard_ok"] else f"**error**: `{case['reshard_error']}`"


def _own_run(run: dict[str, Any]) -> str:
    return _diff(run["max_abs_diff_vs_reshard"]) if run["ok"] else f"**error**: `{run['error']}`"


def measured(data: dict[str, Any]) -> float:
    """The largest |loss difference| between transformers and reshard where transformers agrees."""
    return max((c["max_abs_diff_vs_reshard"] for f in data["models"].values() for c in f["resumed"].values()
                if c["transformers"] == "agrees"), default=0.0)


def _why(case: dict[str, Any], run: dict[str, Any]) -> str:
    """What a resume that does not agree shows beyond its losses."""
    notes = ["its reloaded state equals what it saved"] if case["transformers"] == "diverges" else []
    resumed, trained = case.get("tied_head_rows_differ"), run.get("tied_head_rows_differ")
    if resumed:
        notes.append(f"from step {resumed['from_step']} on, its output head computes with {resumed['rows']} rows "
                     f"({resumed['first']}-{resumed['last']}) of the tied weight at other values than the embedding's "
                     "in the same forward" + (f" (trained from step 1: from step {trained['from_step']})" if trained else ""))
    return "; ".join(notes) or "see the JSON"


def _steps(data: dict[str, Any]) -> list[str]:
    """Step by step, each resume where transformers does not agree: both sides' losses after the save."""
    lines: list[str] = []
    for model, f in data["models"].items():
        for layout, case in _in_order(f["resumed"]):
            if case["transformers"] == "agrees":
                continue
            tf, rs = case["losses"]["transformers"], case["losses"]["reshard"]
            steps = sorted({int(s) for s in (*tf, *rs)})
            lines += ["", f"`{model}` resumed at {NAMES[layout]}, the losses after the save; {_why(case, f['runs'][layout])}:",
                      "",
                      "| step | reshard (uninterrupted) | reshard resumed | transformers resumed | difference |",
                      "|---:|---:|---:|---:|---:|"]
            for s in steps:
                a, b, ref = tf.get(str(s)), rs.get(str(s)), f["reference_losses"].get(str(s))
                cells = [f"{x:.6f}" if x is not None else "-" for x in (ref, b, a)]
                gap = f"{abs(a - b):.1e}" if a is not None and b is not None else "-"
                lines.append(f"| {s} | {' | '.join(cells)} | {gap} |")
    return lines


def render(data: dict[str, Any]) -> str:
    t = data["train"]
    head = (f"From `tests/trainer/results/vs_transformers.json` (`python scripts/vs_transformers.py`), transformers "
            f"{data['transformers_version']}, torch {data['torch_version']}: {t['steps']} steps of a global batch of "
            f"{t['batch_size']} x {t['seq_len']} tokens (lr {t['lr']}, warmup {t['warmup']}, cosine to {t['min_lr']}, "
            f"clipping at {t['max_norm']}), saved after step {t['save_at']} at {NAMES[data['saved_at']]}, resumed at "
            f"each layout and run to step {t['steps']}; losses compared at steps {t['save_at'] + 1}-{t['steps']}. "
            f"Tolerance {data['tolerance']:.0e}; where transformers agrees, the largest difference measured is "
            f"{measured(data):.1e}.")
    rows = ["| model | resumed at | transformers | its reloaded state vs what it saved | its losses vs reshard's "
            "(max abs diff) | transformers trained at this layout from step 1 vs reshard | reshard resumed vs its "
            "uninterrupted run |", "|---|---|---|---|---:|---:|---:|"]
    for model, f in data["models"].items():
        for layout, case in _in_order(f["resumed"]):
            rows.append(f"| `{model}` | {NAMES[layout]} | {_outcome(case)} | {_state(case['reloaded'])} | "
                        f"{_diff(case['max_abs_diff_vs_reshard'])} | {_own_run(f['runs'][layout])} | {_reshard(case)} |")
    return "\n".join([head, "", *rows, *_steps(data)])


def gen_vs_transformers() -> str:
    return render(json.loads(RESULTS.read_text(encoding="utf-8")))

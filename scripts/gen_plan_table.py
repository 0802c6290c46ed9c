"""Regenerate reshard/rules/tp_plans/table.json from the installed transformers (rerun when transformers adds models).

    .venv/bin/python scripts/gen_plan_table.py            # writes reshard/rules/tp_plans/table.json
    .venv/bin/python scripts/gen_plan_table.py --check    # exit 1 if the table differs from transformers

The table holds, for every model_type whose config class declares a `base_model_tp_plan`, exactly what
`reshard.rules.tp_plans.live.live_entry` reads at run time, and the transformers version it came from, so a
machine without transformers plans the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(ROOT) not in sys.path:  # run as `python scripts/gen_plan_table.py`: for `scripts.*`
    sys.path.insert(0, str(ROOT))

from reshard.rules.tp_plans.entry import TABLE_PATH  # noqa: E402
from reshard.rules.tp_plans.live import live_entry, plan_model_types, transformers_version  # noqa: E402
from scripts._generated import write_or_check  # noqa: E402


def build() -> dict:
    plans = {}
    for model_type in plan_model_types():
        entry = live_entry(model_type)
        if entry is not None:
            plans[model_type] = entry.to_dict()
    return {"transformers_version": transformers_version(), "plans": plans}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped table instead of writing it")
    args = parser.parse_args(argv)
    text = json.dumps(build(), indent=1, sort_keys=True) + "\n"
    return write_or_check(TABLE_PATH, text, check=args.check, done=f"wrote {TABLE_PATH}: {len(json.loads(text)['plans'])} "
                          f"architectures, transformers {transformers_version()}")


if __name__ == "__main__":
    sys.exit(main())

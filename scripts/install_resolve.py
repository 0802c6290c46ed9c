"""What pip would install for reshard, with this machine's pip configuration turned off (docs/install.md).

    python scripts/install_resolve.py                       # PyPI (+ PyTorch's CPU index for the set-up)
    python scripts/install_resolve.py --cpu-wheels DIR      # DIR stands in for PyTorch's CPU index
    python scripts/install_resolve.py --json                # the same, as JSON

Asks `pip install --dry-run --ignore-installed --report -` (nothing is installed) in an environment with no
pip configuration: PIP_CONFIG_FILE=/dev/null (no config file is read, global or user) and no other PIP_*
variable, so the only index is PyPI. Three resolutions:

- `base`: `pip install .`, the base install;
- `torch`: `pip install -c constraints.txt torch`, the pinned torch as PyPI offers it (on Linux: the CUDA
  build, with its nvidia/cuda/triton wheels);
- `setup`: what `./run setup` ends with on a machine without a GPU: the CPU torch (PyTorch's CPU index,
  `https://download.pytorch.org/whl/cpu`; or `--cpu-wheels DIR`, a folder holding that wheel, where the
  index cannot be reached), then `.[test]` pinned by constraints.txt.

Each line: the distributions pip would install, the torch among them, and every CUDA package (nvidia-*,
cuda-*, triton). Exit status 1 if `base` has torch, or `base` or `setup` any CUDA package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(ROOT) not in sys.path:  # run as `python scripts/install_resolve.py`: for `scripts.*`
    sys.path.insert(0, str(ROOT))

from scripts.torch_choice import CPU_INDEX, CUDA_PREFIXES  # noqa: E402


def no_pip_config_env() -> dict[str, str]:
    """This environment, less every PIP_* variable, with no pip configuration file read."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def resolve(python: str, args: list[str]) -> list[dict[str, Any]]:
    """pip's install report for `pip install ARGS` (dry run): its `install` entries."""
    cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=no_pip_config_env(), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{r.stderr.strip()}")
    return json.loads(r.stdout)["install"]


def summary(items: list[dict[str, Any]]) -> dict[str, Any]:
    names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}
    return {"distributions": len(names), "torch": names.get("torch"), "transformers": names.get("transformers"),
            "cuda": sorted(n for n in names if n.startswith(CUDA_PREFIXES))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the interpreter whose pip resolves (default: this one)")
    p.add_argument("--cpu-wheels", metavar="DIR", help="a folder with the CPU torch wheel, instead of PyTorch's CPU index")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    cpu = ["--find-links", str(Path(args.cpu_wheels).resolve())] if args.cpu_wheels else ["--extra-index-url", CPU_INDEX]
    pins = ["-c", "constraints.txt"]
    out = {
        "base": summary(resolve(args.python, ["."])),
        "torch": summary(resolve(args.python, [*pins, "torch"])),
        # the CPU build's local version (2.13.0+cpu) sorts above PyPI's 2.13.0: pip takes it, as ./run's
        # step 3 does from the CPU index alone
        "setup": summary(resolve(args.python, [*pins, *cpu, ".[test]"])),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, s in out.items():
            print(f"{name:6} {s['distributions']:3} distributions, torch {s['torch'] or '-'}, "
                  f"transformers {s['transformers'] or '-'}, CUDA packages: {', '.join(s['cuda']) or 'none'}")
    bad = [n for n in ("base", "setup") if out[n]["cuda"]] + (["base (torch)"] if out["base"]["torch"] else [])
    if bad:
        print(f"not as docs/install.md says: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Which torch build `./run`'s set-up installs here (docs/install.md, "What ./run installs").

    python scripts/torch_choice.py [-c constraints.txt]    # one line: HOW<TAB>WHY

Asks pip, installing nothing, which torch it would take for the constraints' pin (`pip install --dry-run
--no-deps --report - -c FILE torch`, with pip's own configuration: a local folder or mirror counts) and
reads that wheel's requirements. HOW is one of:

- `keep`: the installed torch meets the pin;
- `default`: install what pip found: a wheel that needs no CUDA package (a CPU wheel, macOS's), or a CUDA
  build on a machine where `nvidia-smi` sees a GPU;
- `cpu-index`: pip found a CUDA build (it requires nvidia-*, cuda-* or triton packages: PyPI's Linux
  wheels) and no GPU is seen: install from PyPI's sibling, PyTorch's CPU index.

Runs in the set-up's fresh environment: the standard library and pip only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
from typing import Any

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_PREFIXES = ("nvidia-", "cuda-", "triton")


def cuda_requirements(metadata: dict[str, Any]) -> list[str]:
    """The CUDA packages a wheel (pip's report metadata) requires on this machine, without extras."""
    reqs = map(Requirement, metadata.get("requires_dist") or [])
    return sorted(r.name for r in reqs if r.name.lower().startswith(CUDA_PREFIXES)
                  and (r.marker is None or r.marker.evaluate({"extra": ""})))


def choose(report: dict[str, Any], *, gpu: bool) -> tuple[str, str]:
    """(HOW, WHY) from pip's install report of `torch` (dry run, no deps)."""
    items = report["install"]
    if not items:
        return "keep", f"torch {importlib.metadata.version('torch')} is installed and meets the pin"
    meta = items[0]["metadata"]
    found = f"torch=={meta['version']}"
    cuda = cuda_requirements(meta)
    if not cuda:
        return "default", f"{found} (it needs no CUDA package)"
    if gpu:
        return "default", f"{found} (a CUDA build: nvidia-smi sees a GPU)"
    return "cpu-index", f"no NVIDIA GPU here and pip offers {found}, a CUDA build (it requires {len(cuda)} CUDA packages): " \
                        f"the CPU build from {CPU_INDEX}"


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True, check=False).returncode == 0


def pip_report(constraints: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet", "--report", "-",
           "-c", constraints, "torch"]
    return json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--constraints", default="constraints.txt")
    args = p.parse_args(argv)
    how, why = choose(pip_report(args.constraints), gpu=has_nvidia_gpu())
    print(f"{how}\t{why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

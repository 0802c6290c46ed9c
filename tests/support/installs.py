"""Installs under test: reshard's base install in a fresh virtual environment, and `./run`'s torch choice.

    venv = BaseVenv.create(tmp / "venv", wheel_dir=tmp / "dist")
    venv.run("plan", ckpt, "--tp", "2")          # the venv's own `reshard` script, CompletedProcess
    venv.imports_attempted()                      # torch/transformers imports tried so far (with stacks)
    fake_wheel(tmp / "wheels", "torch", "9.0.0", ["triton"])    # metadata-only wheels for pip to choose from
    torch_choice(tmp, "pins.txt", gpu=False)      # scripts/torch_choice.py's line, pip seeing TMP/wheels only

The venv holds the base install and nothing else (no torch, no transformers), made offline, in seconds,
as a user's `pip install reshard-*.whl` would leave it:
- the wheel is built from this checkout (`pip wheel --no-deps --no-build-isolation`: setuptools, the
  build backend, comes with the test extras) and installed with `pip --python VENV install --no-deps
  --no-index`, so its metadata, package data and `reshard` script are what a user gets;
- its dependencies are what the wheel's metadata requires, no more: the closure of its `Requires-Dist`
  (without extras; with the extras a requirement names, `uvicorn[standard]`) over the distributions of
  this test environment, linked file by top-level entry into one directory that a `.pth` file adds.
  A torch that the metadata required would be linked too and then found by tests/e2e/test_install.py,
  and `pip check` in the venv proves every requirement is met without it;
- a `sitecustomize.py` records every attempt to import torch or transformers (name and stack, into
  `imports.log`) and refuses it, in every process the venv's python starts (serve's workers too).
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")  # what a base install never imports (pyproject's [train] and [fill] bring them)

SITECUSTOMIZE = '''\
"""Installed by tests/support/installs.py: an import of {heavy} is recorded and refused."""
import os, sys, traceback

class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            with open({log!r}, "a") as f:
                f.write(f"pid {{os.getpid()}} imports {{name}}:\\n" + "".join(traceback.format_stack()) + "\\n")
            raise ModuleNotFoundError(f"{{name}}: refused in a base install (tests/support/installs.py)", name=name)
        return None

sys.meta_path.insert(0, _Refuse())
'''


def base_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's `Requires-Dist` that apply without extras (on this interpreter)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def closure(reqs: list[Requirement]) -> dict[str, md.Distribution]:
    """Every distribution of this environment that `reqs` need, transitively (name -> distribution);
    a requirement this environment does not meet raises, naming it."""
    found: dict[str, md.Distribution] = {}
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise AssertionError(f"{req}: not installed in this test environment ({sys.prefix})") from None
        if not req.specifier.contains(dist.version, prereleases=True):
            raise AssertionError(f"{req}: this test environment has {dist.version}")
        if name not in found:
            found[name] = dist
            for sub in map(Requirement, dist.requires or []):
                extras = [""] + sorted(req.extras)
                if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                    todo.append(sub)
        elif req.extras:  # seen without these extras: their requirements still count
            for sub in map(Requirement, dist.requires or []):
                if sub.marker is not None and any(sub.marker.evaluate({"extra": e}) for e in req.extras):
                    todo.append(sub)
    return found


def _link(dists: dict[str, md.Distribution], into: Path) -> None:
    """Each distribution's top-level entries (packages, modules, .dist-info, .libs) as symlinks in `into`."""
    into.mkdir(parents=True)
    for name, dist in sorted(dists.items()):
        if dist.files is None:
            raise AssertionError(f"{name}: installed without a RECORD, its files are unknown")
        for top in sorted({f.parts[0] for f in dist.files if f.parts[0] != ".."}):
            target, link = Path(dist.locate_file(top)), into / top
            if target.exists() and not link.exists():
                link.symlink_to(target)


@dataclass
class BaseVenv:
    root: Path
    wheel: Path
    deps: dict[str, md.Distribution]

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def log(self) -> Path:
        return self.root / "imports.log"

    @classmethod
    def create(cls, root: Path, *, wheel_dir: Path) -> BaseVenv:
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        src = wheel_dir / "src"  # a copy: a build in this checkout would leave build/ and reshard.egg-info in it
        shutil.copytree(REPO / "reshard", src / "reshard", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, src / name)
        venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
        out = cls(root, Path(), {})
        subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(src)],
                       check=True, capture_output=True, text=True, timeout=300, env=out.env())
        out.wheel = next(wheel_dir.glob("reshard-*.whl"))
        out.deps = closure(base_requirements(out.wheel))
        site = Path(subprocess.run([str(out.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        _link(out.deps, root / "deps")
        (site / "reshard-test-deps.pth").write_text(str(root / "deps") + "\n")
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(heavy=HEAVY, log=str(out.log)))
        subprocess.run([*pip, "--python", str(out.python), "install", "--no-deps", "--no-index", "-q", str(out.wheel)],
                       check=True, capture_output=True, text=True, timeout=300, env=out.env())
        return out

    def env(self) -> dict[str, str]:
        """The environment for the venv's commands: this one's, less anything that would put this checkout
        or another environment's packages on the path."""
        drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
        return {k: v for k, v in os.environ.items() if k not in drop} | {"VIRTUAL_ENV": str(self.root)}

    def command(self, *args: object) -> list[str]:
        return [str(self.root / "bin" / "reshard"), *map(str, args)]

    def run(self, *args: object, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`reshard ARGS` from the venv's script (cwd: the venv, never this checkout)."""
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout, check=False,
                              cwd=cwd or self.root, env=self.env())

    def python_run(self, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=120,
                              check=False, cwd=self.root, env=self.env())

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        """This environment's pip, acting on the venv (`pip --python VENV ...`)."""
        return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(self.python),
                               *args], capture_output=True, text=True, timeout=120, check=False, env=self.env())

    def imports_attempted(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A wheel with only metadata (and an empty package): what pip reads to choose among candidates."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def torch_choice(tmp: Path, constraints: str, *, gpu: bool) -> str:
    """`python scripts/torch_choice.py -c CONSTRAINTS` in `tmp` (its pip sees only TMP/wheels, no index), with
    an `nvidia-smi` on PATH that sees a GPU or not; returns its line."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{'echo GPU 0: fake' if gpu else 'echo no devices found >&2; exit 9'}\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {
        "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp / "wheels"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "torch_choice.py"), "-c", constraints], cwd=tmp,
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()

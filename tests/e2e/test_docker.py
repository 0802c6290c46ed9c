"""Docker cannot run here: check the compose file and images name things that exist and work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_compose_parses_and_names_what_exists() -> None:
    c = _compose()
    services = c["services"]
    assert {"reshard", "trainer-0", "trainer-1", "seed"} <= set(services)
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", dockerfile, re.M))
    for name, svc in services.items():
        build = svc["build"]
        assert (ROOT / "docker" / build["context"] / build["dockerfile"]).resolve() == ROOT / "docker" / "Dockerfile"
        assert build["target"] in targets, name
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in c["volumes"], (name, vol)
    assert services["reshard"]["ports"] == ["8000:8000"]
    assert services["trainer-1"]["command"][-1] == services["trainer-0"]["command"][-1]
    # the trainers pull from the service by its compose name and the checkpoint the seed job writes
    url = services["trainer-0"]["command"][services["trainer-0"]["command"].index("--shards") + 1]
    seed_dir = services["seed"]["command"][3]
    assert url == f"http://reshard:8000/v1/checkpoints/{Path(seed_dir).name}"
    assert services["trainer-0"]["depends_on"]["reshard"]["condition"] == "service_healthy"
    assert "HEALTHCHECK" in dockerfile and "/healthz" in dockerfile and "USER reshard" in dockerfile


def test_compose_commands_work_outside_docker(tmp_path: Path) -> None:
    services = _compose()["services"]
    # seed: python -m reshard.testing.synth DIR --preset ...  (run with the tiny preset to stay fast)
    seed = services["seed"]["command"]
    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, *seed[1:3], str(out), "--preset", "tiny"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    # service and trainer commands parse (their end-to-end runs are the demo and README tests)
    serve = services["reshard"]["command"]
    assert serve[:2] == ["reshard", "serve"]
    r = subprocess.run([sys.executable, "-m", "reshard.cli", *serve[1:2], "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--root" in r.stdout and "--out" in r.stdout
    train = services["trainer-0"]["command"]
    module = train[train.index("-m") + 1]
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in [a for a in train[train.index("-m") + 2 :] if a.startswith("--")]:
        assert flag in r.stdout, flag
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, text=True)
    for flag in [a for a in train[: train.index("-m")] if a.startswith("--")]:
        assert flag in r.stdout, flag

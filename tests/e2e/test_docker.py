"""docker/: the compose file and the Dockerfile name what exists, take their settings from RESHARD_*, keep
the service on 127.0.0.1 unless told otherwise and refuse a public bind without a token; and where buildah
and podman are installed, the service image is built here (on a base made from Debian's packages) and
`reshard serve` runs from it and serves shards (tests/support/containers.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load, load_file

from reshard.testing.local_servers import free_port
from tests.support import containers
from tests.support.core import assert_same, even_chunk
from tests.support.live import make_ckpt

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def _interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's `${VAR}` / `${VAR:-default}` substitution, over lists and mappings too."""
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m[1]) or (m[2] or ""), value)


def _stage(target: str) -> str:
    """The Dockerfile's lines from `FROM ... AS target` to the next FROM."""
    return re.search(rf"^FROM \S+ AS {target}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S)[1]


def test_compose_parses_and_names_what_exists() -> None:
    c = _compose()
    services = c["services"]
    assert {"reshard", "trainer-0", "trainer-1", "seed", "bind-check"} <= set(services)
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", DOCKERFILE, re.M))
    for name, svc in services.items():
        build = svc["build"]
        assert (ROOT / "docker" / build["context"] / build["dockerfile"]).resolve() == ROOT / "docker" / "Dockerfile"
        assert build["target"] in targets, name
        assert svc["image"].split(":")[0] == f"reshard-{build['target']}", name
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in c["volumes"], (name, vol)
    assert services["trainer-1"]["command"][-1] == services["trainer-0"]["command"][-1]
    # the trainers pull from the service by its compose name, on its port, the checkpoint the seed job writes
    url = services["trainer-0"]["command"][services["trainer-0"]["command"].index("--shards") + 1]
    assert _interpolate(url, {}) == f"http://reshard:8000/v1/checkpoints/{Path(services['seed']['command'][0]).name}"
    assert _interpolate(url, {"RESHARD_PORT": "9100"}).startswith("http://reshard:9100/")
    assert services["trainer-0"]["depends_on"]["reshard"]["condition"] == "service_healthy"
    deps = services["reshard"]["depends_on"]
    assert deps["bind-check"]["condition"] == deps["seed"]["condition"] == "service_completed_successfully"
    assert "HEALTHCHECK" in DOCKERFILE and "/healthz" in DOCKERFILE and "USER reshard" in _stage("service")


def test_service_takes_its_settings_from_the_environment() -> None:
    service = _stage("service")
    # `reshard serve` with no flag: nothing overrides RESHARD_* (the image's or the user's)
    assert re.findall(r"^CMD (.*)$", service, re.M) == ['["reshard", "serve"]']
    env = dict(re.findall(r"(RESHARD_\w+)=(\S+)", service))
    assert env == {"RESHARD_ROOT": "/data/checkpoints", "RESHARD_OUT": "/data/out",
                   "RESHARD_GATHER_DIR": "/data/out/.gathered", "RESHARD_HOST": "0.0.0.0", "RESHARD_PORT": "8000"}
    svc = _compose()["services"]["reshard"]
    assert "command" not in svc and "entrypoint" not in svc
    # the healthcheck asks the port RESHARD_PORT names
    check = re.search(r"^HEALTHCHECK .*?\n\s*CMD (.*)$", service, re.M | re.S)[1]
    assert "RESHARD_PORT" in check and ":8000" not in check
    # published on 127.0.0.1 unless RESHARD_BIND says otherwise, on RESHARD_PORT inside and out
    assert _interpolate(svc["ports"], {}) == ["127.0.0.1:8000:8000"]
    env = {"RESHARD_BIND": "0.0.0.0", "RESHARD_PORT": "9100", "RESHARD_TOKEN": "t"}
    assert _interpolate(svc["ports"], env) == ["0.0.0.0:9100:9100"]
    assert _interpolate(svc["environment"], env) == {"RESHARD_TOKEN": "t", "RESHARD_PORT": "9100"}


@pytest.mark.parametrize("bind, token, ok", [
    (None, "", True), ("127.0.0.1", "", True), ("127.0.0.2", "", True), ("localhost", "", True),
    ("[::1]", "", True), ("0.0.0.0", "", False), ("192.0.2.7", "", False), ("[::]", "", False),
    ("myhost.example", "", False), ("0.0.0.0", "s3cret", True), ("[::]", "s3cret", True),
])
def test_bind_check_refuses_a_public_bind_without_a_token(bind: str | None, token: str, ok: bool) -> None:
    svc = _compose()["services"]["bind-check"]
    user_env = {"RESHARD_TOKEN": token} | ({"RESHARD_BIND": bind} if bind is not None else {})
    env = {k: str(v) for k, v in _interpolate(svc["environment"], user_env).items()}
    assert svc["entrypoint"] == ["python", "-c"]
    r = subprocess.run([sys.executable, "-c", *svc["command"]], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=60)
    if ok:
        assert (r.returncode, r.stderr) == (0, "")
    else:
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"bind-check: refusing to publish the service on {bind} without a token")
        assert "RESHARD_TOKEN" in r.stderr


def test_compose_commands_work_outside_docker(tmp_path: Path) -> None:
    services = _compose()["services"]
    # seed: python -m reshard.testing.synth DIR --preset ...  (run with the tiny preset to stay fast)
    seed = [*services["seed"]["entrypoint"], *services["seed"]["command"]]
    assert seed[:3] == ["python", "-m", "reshard.testing.synth"]
    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, *seed[1:3], str(out), "--preset", "tiny"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "serve", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "RESHARD_ROOT" in r.stdout
    train = services["trainer-0"]["command"]
    module = train[train.index("-m") + 1]
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in [a for a in train[train.index("-m") + 2 :] if a.startswith("--")]:
        assert flag in r.stdout, flag
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, text=True)
    for flag in [a for a in train[: train.index("-m")] if a.startswith("--")]:
        assert flag in r.stdout, flag


# --- the service image, built and run here ---------------------------------------------------------

def _torch_in_base() -> bool:
    deps = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)[1]
    return re.search(r'^\s*"torch\b', deps, re.M) is not None


def _expected_shard(src: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Llama's plan with plain torch: q/k/v, gate/up, the embedding and lm_head split on dim 0, o/down on
    dim 1, the norms whole (tiny's 256-row vocabulary and 2 kv heads divide by tp=2: no padding)."""
    out = {}
    for name, t in src.items():
        if re.search(r"(q|k|v|gate|up)_proj\.weight$|embed_tokens\.weight$|lm_head\.weight$", name):
            out[name] = even_chunk(t, tp, rank, 0)
        elif re.search(r"(o|down)_proj\.weight$", name):
            out[name] = even_chunk(t, tp, rank, 1)
        else:
            out[name] = t
    return out


@pytest.mark.timeout(2400)
def test_service_image_builds_and_serves(tmp_path: Path) -> None:
    if missing := containers.missing_tools():
        pytest.skip(f"building images needs {', '.join(missing)}: apt-get install -y buildah podman debootstrap")
    if _torch_in_base():
        pytest.skip("the service image holds no torch, and the base package still requires it (pyproject)")
    base = containers.base_image()
    if base is None:
        pytest.skip(f"no {containers.BASE_IMAGE} and no debootstrap to make it (docker/make-base.sh)")
    tag = f"localhost/reshard-service-test:{os.getpid()}"
    containers.build_image("service", tag, base=base)
    try:
        info = json.loads(containers.podman("image", "inspect", tag).stdout)[0]
        assert info["Config"]["User"] == "reshard" and info["Config"]["Cmd"] == ["reshard", "serve"]
        assert info["Healthcheck"]["Test"][0] == "CMD-SHELL" and "RESHARD_PORT" in info["Healthcheck"]["Test"][1]
        probe = containers.podman("run", "--rm", *containers.ulimits(), tag, "python", "-c",
                                  "import importlib.util as u, os; print(u.find_spec('torch'), os.getuid())")
        assert probe.stdout.split() == ["None", "10001"]  # no torch; not root
        # compose's bind-check, in the image: a public bind without a token is refused
        check = _compose()["services"]["bind-check"]
        refused = containers.podman("run", "--rm", *containers.ulimits(), "-e", "RESHARD_BIND=0.0.0.0",
                                    "--entrypoint", check["entrypoint"][0], tag, *check["entrypoint"][1:],
                                    *check["command"], check=False)
        assert refused.returncode == 1 and "refusing to publish the service on 0.0.0.0" in refused.stderr

        root = tmp_path / "root"
        make_ckpt(root / "tiny")
        for p in [root, *root.rglob("*")]:  # the container's user reads what the test's user wrote
            p.chmod(0o755 if p.is_dir() else 0o644)
        port = free_port()  # not 8000: the healthcheck and the bind follow RESHARD_PORT
        env = {"RESHARD_PORT": str(port), "RESHARD_WORKERS": "1", "RESHARD_TOKEN": "img-s3cret",
               "RESHARD_PUBLIC_DOCS": "true"}
        name = f"reshard-test-{os.getpid()}"
        with containers.container(tag, name=name, port=port, env=env, volumes={root: "/data/checkpoints:ro"}):
            url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer img-s3cret"}
            assert httpx.get(f"{url}/v1/checkpoints", timeout=10).status_code == 401
            listed = httpx.get(f"{url}/v1/checkpoints", headers=auth, timeout=10).json()["checkpoints"]
            assert [c["name"] for c in listed] == ["tiny"]
            src = load_file(root / "tiny" / "model.safetensors")
            for rank in range(2):
                r = httpx.get(f"{url}/v1/checkpoints/tiny/shards/{rank}", params={"tp": 2}, headers=auth, timeout=60)
                assert r.status_code == 200, r.text
                got, want = load(r.content), _expected_shard(src, 2, rank)
                assert sorted(got) == sorted(want)
                for k, t in want.items():
                    assert_same(got[k], t, f"rank {rank} {k}")
            # the API page works from the image alone
            page = httpx.get(f"{url}/docs", timeout=10)
            assert page.status_code == 200 and "https://" not in page.text
            assert httpx.get(f"{url}/docs/assets/swagger-ui-bundle.js", timeout=10).status_code == 200
            # the image's HEALTHCHECK, run by podman in the container: healthy on RESHARD_PORT
            health = containers.podman("healthcheck", "run", name, check=False)
            assert health.returncode == 0, (health.stdout, health.stderr, containers.logs(name))
            log = containers.logs(name)
            assert f"Uvicorn running on http://0.0.0.0:{port}" in log and "Traceback" not in log, log
    finally:
        containers.podman("rmi", "-f", tag, check=False)

"""Build docker/Dockerfile's images with buildah and run them with podman, as docs/docker.md does, for
tests/e2e/test_docker.py.

    base = base_image()                      # localhost/reshard-base:bookworm, made by docker/make-base.sh once
    build_image("service", tag, base=base)   # buildah build --isolation chroot --build-arg BASE=...
    with container(tag, port=..., volumes={...}) as name:
        podman("healthcheck", "run", name)

No registry is needed: the base image comes from Debian's packages (debootstrap), the build steps reach
PyPI as pip does here (with pip's CA, `$PIP_CERT`, handed over as a build secret when it is set).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.live import REPO

BASE_IMAGE = "localhost/reshard-base:bookworm"


def missing_tools() -> list[str]:
    """What building and running the images here needs and is not installed (or allowed)."""
    missing = [t for t in ("buildah", "podman") if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root (buildah's chroot builds and podman's containers run as root here)")
    return missing


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`podman ARGS`; runc rather than crun where it is installed: crun refuses hybrid cgroup v1/v2 hosts."""
    runtime = ["--runtime", "runc"] if shutil.which("runc") else []
    r = subprocess.run(["podman", *runtime, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def image_exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


def base_image() -> str | None:
    """The Debian base image, made with docker/make-base.sh if it is not there yet (minutes, ~130 MB);
    None where it cannot be made here (no debootstrap)."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    if shutil.which("debootstrap") is None:
        return None
    r = subprocess.run([str(REPO / "docker" / "make-base.sh"), BASE_IMAGE], capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, f"docker/make-base.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return BASE_IMAGE


def build_image(target: str, tag: str, *, base: str, timeout: float = 900) -> str:
    """`buildah build --isolation chroot` of docker/Dockerfile's `target` on `base`; the build log."""
    cmd = ["buildah", "build", "--isolation", "chroot", "--layers", "--format", "docker",
           "--build-arg", f"BASE={base}", "-f", "docker/Dockerfile", "--target", target, "-t", tag]
    cert = os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():
        cmd += ["--secret", f"id=pip-cert,src={cert}"]
    r = subprocess.run([*cmd, "."], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def ulimits() -> list[str]:
    """podman's default limits (nofile 1048576...) are above what a process without CAP_SYS_RESOURCE may
    set; the container gets this process's open-file limit and a modest process limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ["--ulimit", f"nofile={soft}:{hard}", "--ulimit", "nproc=4096:4096"]


@contextlib.contextmanager
def container(image: str, *, name: str, port: int, env: dict[str, str], volumes: dict[Path, str],
              timeout: float = 60) -> Iterator[str]:
    """`podman run -d` of `image` with its own command, published on 127.0.0.1:port, until the block
    ends; waits for /healthz. Yields the container's name."""
    args = ["run", "-d", "--name", name, *ulimits(), "-p", f"127.0.0.1:{port}:{port}"]
    for k, v in env.items():
        args += ["-e", f"{k}={v}"]
    for host, inside in volumes.items():
        args += ["-v", f"{host}:{inside}"]
    try:
        podman(*args, image)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            state = podman("inspect", name, "--format", "{{.State.Status}}", check=False).stdout.strip()
            assert state in ("created", "running"), f"container {state}:\n{logs(name)}"
            time.sleep(0.3)
        else:
            raise AssertionError(f"no /healthz on port {port} after {timeout} s:\n{logs(name)}")
        yield name
    finally:
        podman("rm", "-f", "-t", "5", name, check=False)


def logs(name: str) -> str:
    r = podman("logs", name, check=False)
    return r.stdout + r.stderr

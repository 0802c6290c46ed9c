"""Run every command of the README's ```bash blocks, in order, so the README cannot rot."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    return [(m.group(1), m.group(2).splitlines()) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def commands() -> list[str]:
    out = []
    for lang, lines in fenced_blocks(README.read_text()):
        if lang == "bash":
            out += [re.split(r"\s+#\s", line)[0].strip() for line in lines if line.strip()]
    return out


def test_every_command_shown_is_in_a_runnable_block() -> None:
    for lang, lines in fenced_blocks(README.read_text()):
        if lang != "bash":
            shown = [line for line in lines if re.match(r"\s*(reshard|torchrun|curl)\s", line)]
            assert not shown, f"{lang} block shows commands the README test does not run: {shown}"
    assert len(commands()) >= 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_tour_runs(tmp_path: Path) -> None:
    port = str(_free_port())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    background: list[subprocess.Popen] = []
    try:
        for cmd in commands():
            cmd = cmd.replace(":8000", f":{port}").replace("--port 8000", f"--port {port}")
            if cmd.startswith("python "):
                cmd = shlex.quote(sys.executable) + cmd[len("python"):]
            if cmd.startswith("torchrun "):
                cmd = cmd.replace("torchrun ", f"torchrun --master-port {_free_port()} ", 1)
            if cmd.endswith("&"):
                background.append(subprocess.Popen(cmd[:-1], shell=True, cwd=tmp_path, env=env,
                                                   start_new_session=True, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
                for _ in range(150):
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        time.sleep(0.2)
                else:
                    raise AssertionError(f"{cmd}: server did not come up")
                continue
            r = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    finally:
        for p in background:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
    # what the README says of the results
    pulled = (tmp_path / "rank1.safetensors").read_bytes()
    assert pulled == (tmp_path / "shards" / "rank-00001-of-00002.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "shards4").glob("rank-*")) == [
        "rank-00000-of-00004.safetensors", "rank-00002-of-00004.safetensors"]
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    original = {}
    for f in sorted((tmp_path / "ckpts" / "tiny").glob("model-*.safetensors")):
        original.update(load_file(f))
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in original.items()}
    assert len(list((tmp_path / "trained-tp4").glob("rank-*-of-00004.safetensors"))) == 4
    # the Python snippets run too, each in a fresh interpreter, after the commands above
    for lang, lines in fenced_blocks(README.read_text()):
        if lang == "python":
            r = subprocess.run([sys.executable, "-c", "\n".join(lines)], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, "\n".join(lines) + "\n" + r.stderr[-2000:]
    assert (tmp_path / "shards-tp1" / "rank-00000-of-00001.safetensors").is_file()

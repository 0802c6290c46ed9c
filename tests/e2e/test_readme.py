"""Run the snippets of README.md and of every docs/*.md page, so the docs cannot rot.

Each page runs in a fresh temporary directory, its blocks in document order:
- ```bash: each line is one command (text after ` # ` is a comment). A line ending in `&` starts a server
  in the background, waited for until it answers and stopped when the page is done; `export K=V ...`
  sets variables for the page's later commands; `! command` must fail (the shell's negation).
- ```python: each block runs in a fresh interpreter (this venv's python) in that directory.
- a block right after a `<!-- file: NAME -->` line is written to NAME instead (a rules file, a worker).
- other blocks (```text, ```yaml, ```json, ...) are shown and never run; none may show a command.
Ports 8000 and 9000 become free ports, and each torchrun gets a free --master-port.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?:<!-- file: (?P<file>\S+) -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.M | re.S)
PORT = re.compile(r"(:|--port |-p )(8000|9000)\b")
SHOWN_COMMAND = re.compile(r"\s*(?:\$\s*)?(reshard|torchrun|curl)\s")

pytestmark = pytest.mark.e2e


@dataclass
class Block:
    lang: str
    lines: list[str]
    file: str | None


def blocks(page: Path) -> list[Block]:
    return [Block(m["lang"], m["body"].splitlines(), m["file"]) for m in FENCE.finditer(page.read_text())]


def commands(page: Path) -> list[str]:
    return [c for b in blocks(page) if b.lang == "bash" and b.file is None for c in _lines(b)]


def _lines(block: Block) -> list[str]:
    return [re.split(r"\s+#\s", line)[0].strip() for line in block.lines if line.strip() and not line.lstrip().startswith("#")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


class PageRun:
    """One page's snippets in one directory, with the servers its commands start."""

    def __init__(self, page: Path, cwd: Path) -> None:
        self.page, self.cwd = page, cwd
        self.ports = {"8000": str(_free_port()), "9000": str(_free_port())}
        venv_bin = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        self.env.update(PATH=f"{venv_bin}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
                        NO_PROXY="127.0.0.1,localhost", AWS_EC2_METADATA_DISABLED="true")
        self.background: list[tuple[subprocess.Popen[bytes], str]] = []

    def ports_of(self, text: str) -> str:
        return PORT.sub(lambda m: m[1] + self.ports[m[2]], text)

    def run(self) -> None:
        try:
            for b in blocks(self.page):
                if b.file is not None:
                    (self.cwd / b.file).parent.mkdir(parents=True, exist_ok=True)
                    (self.cwd / b.file).write_text(self.ports_of("\n".join(b.lines) + "\n"))
                elif b.lang == "bash":
                    for cmd in _lines(b):
                        self.command(cmd)
                elif b.lang == "python":
                    self.python("\n".join(b.lines))
        finally:
            self.stop()

    def command(self, cmd: str) -> None:
        cmd = self.ports_of(cmd)
        if cmd.startswith("export "):
            for item in shlex.split(cmd[len("export "):]):
                k, _, v = item.partition("=")
                self.env[k] = v
            return
        if cmd.startswith("python "):
            cmd = shlex.quote(sys.executable) + cmd[len("python"):]
        if cmd.startswith("torchrun "):
            cmd = cmd.replace("torchrun ", f"torchrun --master-port {_free_port()} ", 1)
        if cmd.endswith("&"):
            self.start(cmd[:-1].strip())
            return
        r = subprocess.run(cmd, shell=True, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{_page_id(self.page)}: {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    def start(self, cmd: str) -> None:
        log = self.cwd / f".server-{len(self.background)}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen(cmd, shell=True, cwd=self.cwd, env=self.env, start_new_session=True,
                                 stdout=out, stderr=subprocess.STDOUT)
        self.background.append((p, cmd))
        m = re.search(r"(?:--port|-p)\s+(\d+)", cmd)
        assert m, f"{cmd}: a background command must name its port (--port N or -p N)"
        port = int(m[1])
        for _ in range(300):
            assert p.poll() is None, f"{cmd}: exited with {p.returncode}\n{log.read_text()[-3000:]}"
            if self._answers(port, health="reshard serve" in cmd):
                return
            time.sleep(0.2)
        raise AssertionError(f"{cmd}: did not answer on port {port}\n{log.read_text()[-3000:]}")

    @staticmethod
    def _answers(port: int, *, health: bool) -> bool:
        try:
            if health:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except (OSError, httpx.HTTPError):
            return False

    def python(self, code: str) -> None:
        r = subprocess.run([sys.executable, "-c", self.ports_of(code)], cwd=self.cwd, env=self.env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{_page_id(self.page)}: python block failed:\n{code}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"

    def stop(self) -> None:
        for p, _ in self.background:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p, _ in self.background:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_command_shown_is_in_a_runnable_block(page: Path) -> None:
    for b in blocks(page):
        if b.lang not in ("bash", "python") and b.file is None:
            shown = [line for line in b.lines if SHOWN_COMMAND.match(line)]
            assert not shown, f"{_page_id(page)}: a {b.lang or 'plain'} block shows commands no test runs: {shown}"
    text = page.read_text()
    assert text.count("```") % 2 == 0, f"{_page_id(page)}: an unclosed code fence"


def test_readme_is_the_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 260, "the README holds what it is, the commands, the tour, the map and limits"
    assert len(commands(README)) >= 10
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", text))
    pages = {f"docs/{p.name}" for p in PAGES[1:]}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    assert linked <= pages, f"README links pages that do not exist: {sorted(linked - pages)}"


@pytest.mark.parametrize("page", PAGES[1:], ids=_page_id)
def test_docs_page_snippets_run(page: Path, tmp_path: Path) -> None:
    PageRun(page, tmp_path).run()


def test_readme_tour_runs(tmp_path: Path) -> None:
    PageRun(README, tmp_path).run()
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
    assert (tmp_path / "shards-tp1" / "rank-00000-of-00001.safetensors").is_file()  # the Python snippet's
